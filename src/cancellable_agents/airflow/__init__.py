"""Everything that knows about Airflow (the Task SDK, its supervisor, executors)."""
