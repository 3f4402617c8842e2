"""The cancellation core: scope, causes, record, exceptions. Imports neither Airflow nor the
pydantic-ai binding (only pydantic-ai's ``CancellationToken``)."""
