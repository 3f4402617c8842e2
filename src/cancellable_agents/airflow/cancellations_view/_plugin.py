"""The Airflow plugin that puts the Cancellations view in the UI (``provider.yaml``'s
``plugins:``).

Every Airflow component imports plugin classes, the task process too (for macros), so this
module imports only ``AirflowPlugin``: the FastAPI app, SQLAlchemy models and the pages load when
the API server first reads ``fastapi_apps``.
"""

from __future__ import annotations

from typing import Any

from airflow.plugins_manager import AirflowPlugin

__all__ = ["URL_PREFIX", "CancellationsPlugin"]

#: Where the API server mounts the app.
URL_PREFIX = "/cancellations"


class _AppOnFirstUse:
    """``fastapi_apps`` built when first read (a class attribute read on the class)."""

    def __init__(self) -> None:
        self._apps: list[dict[str, Any]] | None = None

    def __get__(self, instance: Any, owner: Any) -> list[dict[str, Any]]:
        if self._apps is None:
            from cancellable_agents.airflow.cancellations_view._app import build_app

            self._apps = [{"app": build_app(URL_PREFIX), "url_prefix": URL_PREFIX, "name": "Cancellations"}]
        return self._apps


class CancellationsPlugin(AirflowPlugin):
    """A tab on the task instance page and a page in the nav, served by one FastAPI app."""

    name = "cancellable_agents_cancellations"
    fastapi_apps = _AppOnFirstUse()  # type: ignore[assignment]
    external_views = [
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
