"""Processes on this host: /proc and signal helpers (:mod:`.proc`) and the descendant reaper
(:mod:`.reaper`). Airflow-free."""
