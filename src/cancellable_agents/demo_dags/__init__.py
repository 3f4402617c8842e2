"""The DAGs folder of ``python -m cancellable_agents.demo``."""
