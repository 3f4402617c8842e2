"""Kill-latency and overhead benchmarks for ``cancellable_agents`` (run on demand: ``make bench``).

``python -m benchmarks.run`` measures, with real SIGTERMs to real task processes and the local
HTTP model server, how long it takes from the kill until the run raised and until everything the
task started is gone, per scenario; and what the cancellation scope costs a normal run. When
``apache-airflow-providers-common-ai`` is importable, the same scenarios run through its
``CancellableAgentRunMixin`` side by side. See :mod:`benchmarks.run` for the options.
"""
