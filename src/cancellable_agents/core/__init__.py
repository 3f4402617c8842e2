"""The cancellation core: scope, causes, timeline, exceptions. Imports neither Airflow nor the
pydantic-ai binding (only pydantic-ai's ``CancellationToken``)."""
