"""``durable=True`` on an operator: which store, which try, checked when the DAG is parsed.

The Airflow side of [`cancellable_agents.durable`][] (which is Airflow-free).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cancellable_agents.airflow._adapter import comms_used_from_a_loop, has_task_state_store
from cancellable_agents.airflow.config import deployment_setting
from cancellable_agents.core.exceptions import ConfigurationError

if TYPE_CHECKING:  # the journal (pydantic-ai) and the stores load when a task runs, not at parse
    from cancellable_agents.airflow.task_try import TaskTry
    from cancellable_agents.durable._journal import Journal
    from cancellable_agents.durable._stores import Store
    from cancellable_agents.durable.options import DurableOptions


def check_durable(operator: Any) -> None:
    """At DAG parse time (operator ``__init__``): refuse ``durable=True`` that cannot work."""
    options: DurableOptions | None = getattr(operator, "durable", None)
    if not options:
        return
    if options.path is None and not has_task_state_store():
        import airflow

        name = getattr(operator, "task_id", type(operator).__name__)
        raise ConfigurationError(
            f"{name}: durable=True needs Airflow 3.3+'s task state store, and this is Airflow "
            f"{airflow.__version__}. Pass durable=DurableOptions(path=...) (an ObjectStoragePath or a path "
            f"such as 's3://bucket/agents' or '/shared/agents') to keep the record there, or upgrade to "
            f"Airflow 3.3."
        )


def journal_for(operator: Any, task_try: TaskTry) -> Journal:
    """The journal of the operator's next ``run_agent_sync`` call in this try.

    Each call of a task gets its own record (keyed by its order in ``execute``), so a task that
    runs several agents resumes each one.
    """
    from cancellable_agents.airflow._metrics import step_write_timer
    from cancellable_agents.durable._journal import Journal

    context = task_try.context
    if context is None:
        from airflow.sdk import get_current_context

        context = get_current_context()
    ti = context.get("ti") if hasattr(context, "get") else None
    if ti is None:
        raise ConfigurationError(
            f"{getattr(operator, 'task_id', '?')}: durable=True needs the task instance (try number, store); "
            f"call run_agent_sync from execute, with the task's context"
        )
    options: DurableOptions = operator.durable
    run_key = task_try.next_run_key()
    return Journal(
        _store(options, context, ti),
        try_number=int(ti.try_number),
        run_key=run_key,
        resume_after_clear=options.resume_after_clear,
        usage_spans_tries=options.usage_limits_span_tries,
        scope=task_try.scope,
        clear_count=_clear_number(context),
        on_step_written=step_write_timer(task_try),
        returns_flush_s=float(_deployment_or(options.flush_after, "durable_flush_after")),
        write_ahead=bool(_deployment_or(options.write_ahead, "durable_write_ahead")),
        batch_window_s=float(_deployment_or(options.batch_window, "durable_batch_window")),
        beside_is_safe=lambda: not comms_used_from_a_loop(),
        answers=task_try.answers_for(run_key),
    )


def _deployment_or(value: float | bool | None, name: str) -> float | bool:
    """An option as the operator set it, else the deployment's ``[cancellable_agents] <name>``."""
    return deployment_setting(name) if value is None else value


def storage_path(value: Any) -> Any:
    """``durable_path=`` as an ``ObjectStoragePath``: a string is a URL (``s3://bucket/agents``)
    or a local path (``/shared/agents``); a path object is used as it is."""
    if not isinstance(value, str):
        return value
    from airflow.sdk import ObjectStoragePath

    return ObjectStoragePath(value if "://" in value else f"file://{value}")


def _clear_number(context: Any) -> int | None:
    """How often the task's DAG run was cleared (``dag_run.clear_number``), if Airflow says."""
    dag_run = context.get("dag_run") if hasattr(context, "get") else None
    number = getattr(dag_run, "clear_number", None)
    return number if isinstance(number, int) else None


def _store(options: DurableOptions, context: Any, ti: Any) -> Store:
    from cancellable_agents.durable._stores import PathStore, TaskStateStore

    if options.path is not None:
        map_index = getattr(ti, "map_index", -1)
        return PathStore.for_task(
            storage_path(options.path),
            ti.dag_id,
            ti.run_id,
            ti.task_id,
            -1 if map_index is None else map_index,
        )
    accessor = context.get("task_state_store") if hasattr(context, "get") else None
    if accessor is None:
        raise ConfigurationError(
            f"{ti.task_id}: durable=True but this task's context has no task_state_store; pass "
            f"durable=DurableOptions(path=...) (an ObjectStoragePath) to keep the record there."
        )
    from airflow.configuration import conf

    return TaskStateStore(accessor, conf.getint("state_store", "max_value_storage_bytes", fallback=0))
