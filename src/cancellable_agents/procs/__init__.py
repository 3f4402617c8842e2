"""Processes on this host: /proc and signal helpers ([`proc`][cancellable_agents.procs.proc])
and the descendant reaper ([`reaper`][cancellable_agents.procs.reaper]). Airflow-free."""
