"""The view's FastAPI app: two pages, each authorized by Airflow's auth manager as the built-in
routes are, each a bounded, paginated query of the stored records.

- ``/ti``: one task instance's records. ``requires_access_dag(GET, TASK_INSTANCE)`` reads the
  ``dag_id`` query parameter, exactly as ``/api/v2/.../state-store`` does: 403 without access.
- ``/fleet``: every record the user may read: the DAG ids the auth manager authorizes
  (``get_authorized_dag_ids``, as ``ReadableDagsFilterDep`` does) filter the query itself.

The user comes from the UI's ``_token`` cookie or a bearer token (Airflow's ``get_user``), so the
tab, an iframe of the same origin, is authorized as the UI is.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated, Any

from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.common.db.common import SessionDep
from airflow.api_fastapi.core_api.security import GetUserDep, requires_access_dag
from airflow.models.task_state_store import TaskStateStoreModel
from fastapi import Depends, FastAPI, HTTPException, Query, Request, status
from fastapi.responses import HTMLResponse
from sqlalchemy import func, select

from cancellable_agents.airflow.cancellations_view._pages import (
    FleetQuery,
    StoredRow,
    fleet_page,
    task_instance_page,
)
from cancellable_agents.airflow.kill_record._stored import KEY_PREFIX

__all__ = ["FLEET_WINDOW", "PAGE_SIZE", "build_app"]

#: Records listed per page of the fleet view.
PAGE_SIZE = 50
#: The fleet's summaries are computed over at most this many records (the newest that match).
FLEET_WINDOW = 1000
#: A task instance shows at most this many tries.
TRIES_SHOWN = 50
#: No script, no outside fetch: a page is markup and inline style only.
_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; frame-ancestors 'self'"

_READ_TI = Depends(requires_access_dag(method="GET", access_entity=DagAccessEntity.TASK_INSTANCE))


def build_app(url_prefix: str) -> FastAPI:
    """The app the plugin mounts at ``url_prefix`` (its pages link to each other under it)."""
    app = FastAPI(title="Cancellations", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.url_prefix = url_prefix
    app.get("/ti", dependencies=[_READ_TI], response_class=HTMLResponse)(task_instance)
    app.get("/fleet", response_class=HTMLResponse)(fleet)
    return app


def _html(body: str) -> HTMLResponse:
    return HTMLResponse(body, headers={"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff"})


def task_instance(
    request: Request,
    session: SessionDep,
    dag_id: Annotated[str, Query(max_length=250)],
    run_id: Annotated[str, Query(max_length=250)],
    task_id: Annotated[str, Query(max_length=250)],
    map_index: Annotated[str, Query(max_length=12)] = "-1",
) -> HTMLResponse:
    """One task instance's stored records, newest try first."""
    index = _map_index(map_index)
    statement = (
        select(TaskStateStoreModel.value)
        .where(
            TaskStateStoreModel.dag_id == dag_id,
            TaskStateStoreModel.run_id == run_id,
            TaskStateStoreModel.task_id == task_id,
            TaskStateStoreModel.map_index == index,
            TaskStateStoreModel.key.startswith(KEY_PREFIX, autoescape=True),
        )
        .order_by(TaskStateStoreModel.updated_at.desc())
        .limit(TRIES_SHOWN)
    )
    rows = [StoredRow(dag_id, run_id, task_id, index, _document(v)) for v in session.scalars(statement)]
    title = f"{dag_id} / {run_id} / {task_id}" + (f" [{index}]" if index >= 0 else "")
    return _html(task_instance_page(title, rows, f"{request.app.state.url_prefix}/fleet"))


def fleet(
    request: Request,
    session: SessionDep,
    user: GetUserDep,
    dag_id: Annotated[str, Query(max_length=250)] = "",
    since: Annotated[str, Query(max_length=40)] = "",
    until: Annotated[str, Query(max_length=40)] = "",
    page: Annotated[int, Query(ge=1, le=10_000)] = 1,
) -> HTMLResponse:
    """The fleet's records the user may read, filtered by DAG and time, one page at a time."""
    readable = get_auth_manager().get_authorized_dag_ids(user=user, method="GET")
    where = [
        TaskStateStoreModel.key.startswith(KEY_PREFIX, autoescape=True),
        TaskStateStoreModel.dag_id.in_(readable),
    ]
    if dag_id:
        where.append(TaskStateStoreModel.dag_id == dag_id)
    if since:
        where.append(TaskStateStoreModel.updated_at >= _instant(since, "since"))
    if until:
        where.append(TaskStateStoreModel.updated_at <= _instant(until, "until"))
    # The ids are sorted alone (a narrow sort), then only those rows' values are read: sorting whole
    # rows made PostgreSQL sort every matching value (10,000 records: 13 MB) per page.
    newest = select(TaskStateStoreModel.id).where(*where).order_by(TaskStateStoreModel.updated_at.desc())
    total = session.scalar(select(func.count()).select_from(TaskStateStoreModel).where(*where)) or 0
    window = _rows(session, session.scalars(newest.limit(FLEET_WINDOW)).all())
    listed = _rows(session, session.scalars(newest.offset((page - 1) * PAGE_SIZE).limit(PAGE_SIZE)).all())
    query = FleetQuery(dag_id=dag_id, since=since, until=until, page=page)
    return _html(
        fleet_page(
            window, listed, total, query, PAGE_SIZE, f"{request.app.state.url_prefix}/ti", FLEET_WINDOW
        )
    )


def _rows(session: Any, ids: Sequence[int]) -> list[StoredRow]:
    """The records of ``ids``, newest first."""
    if not ids:
        return []
    statement = (
        select(
            TaskStateStoreModel.dag_id,
            TaskStateStoreModel.run_id,
            TaskStateStoreModel.task_id,
            TaskStateStoreModel.map_index,
            TaskStateStoreModel.value,
        )
        .where(TaskStateStoreModel.id.in_(ids))
        .order_by(TaskStateStoreModel.updated_at.desc())
    )
    return [
        StoredRow(r.dag_id, r.run_id, r.task_id, r.map_index, _document(r.value))
        for r in session.execute(statement)
    ]


def _document(value: str) -> dict[str, Any]:
    """A stored value as a document; one that does not parse shows as empty, not as an error."""
    try:
        parsed = json.loads(value)
    except (TypeError, ValueError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _map_index(text: str) -> int:
    """The task instance's map index; an unmapped task's page leaves the UI's ``{MAP_INDEX}``
    placeholder unfilled (Airflow 3.3), which means -1."""
    if text in ("", "{MAP_INDEX}"):
        return -1
    try:
        index = int(text)
    except ValueError:
        index = -2
    if index < -1:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"map_index: an integer >= -1, not {text!r}")
    return index


def _instant(text: str, name: str) -> datetime:
    """An ISO date or time from the filter (UTC unless it says otherwise); a 400 naming the fix."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise HTTPException(
            status.HTTP_400_BAD_REQUEST,
            f"{name}: use an ISO date or time, e.g. 2026-12-01 or 2026-12-01T12:00",
        ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
