"""The Airflow plugin that puts the Cancellations view in the UI (an ``airflow.plugins`` entry
point; on Airflow 3.3+ it reads the task state store, on 3.1/3.2 XCom, where only the latest try's
record is kept).

Every Airflow component imports plugin classes, the task process too (for macros), so this
module imports only ``AirflowPlugin``: the FastAPI app, SQLAlchemy models and the pages load when
the API server first reads ``fastapi_apps``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from airflow.plugins_manager import AirflowPlugin

__all__ = ["URL_PREFIX", "CancellationsPlugin"]

#: Where the API server mounts the app.
URL_PREFIX = "/cancellations"


class _MadeOnFirstRead:
    """A plugin attribute made on first read (a class attribute read on the class): the app and
    what it imports load only where Airflow reads it (the API server)."""

    def __init__(self, make: Callable[[], list[dict[str, Any]]]) -> None:
        self._make = make
        self._value: list[dict[str, Any]] | None = None

    def __get__(self, instance: Any, owner: Any) -> list[dict[str, Any]]:
        if self._value is None:
            self._value = self._make()
        return self._value


def _apps() -> list[dict[str, Any]]:
    from cancellable_agents.airflow.cancellations_view._app import build_app

    return [{"app": build_app(URL_PREFIX), "url_prefix": URL_PREFIX, "name": "Cancellations"}]


def _views() -> list[dict[str, Any]]:
    return [
        {
            "name": "Cancellations",
            # The UI fills the placeholders with the page's task instance, URL-encoded.
            "href": f"{URL_PREFIX}/ti?dag_id={{DAG_ID}}&run_id={{RUN_ID}}&task_id={{TASK_ID}}"
            "&map_index={MAP_INDEX}",
            "destination": "task_instance",
            "url_route": "cancellations_ti",
        },
        {
            "name": "Cancellations",
            "href": f"{URL_PREFIX}/fleet",
            "destination": "nav",
            "category": "browse",
            "url_route": "cancellations",
        },
    ]


class CancellationsPlugin(AirflowPlugin):
    """A tab on the task instance page and a page in the nav, served by one FastAPI app."""

    name = "cancellable_agents_cancellations"
    fastapi_apps = _MadeOnFirstRead(_apps)  # type: ignore[assignment]
    external_views = _MadeOnFirstRead(_views)  # type: ignore[assignment]
