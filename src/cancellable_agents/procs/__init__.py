"""Processes on this host: /proc and signal helpers ([`proc`][cancellable_agents.procs._proc])
and the descendant reaper ([`reaper`][cancellable_agents.procs._reaper]). Airflow-free."""
