"""The view's FastAPI app: two pages, each authorized by Airflow's auth manager as the built-in
routes are, each a bounded, paginated query of the stored records.

The records are read where the tasks store them: Airflow 3.3's task state store (every try), or
XCom on Airflow 3.1/3.2 (the same keys; Airflow clears a task instance's XCom when its next try
starts, so there only the latest try's record is there). [`Records`][] is that one choice.

- ``/ti``: one task instance's records. ``requires_access_dag(GET, TASK_INSTANCE)`` reads the
  ``dag_id`` query parameter, exactly as ``/api/v2/.../state-store`` does: 403 without access.
- ``/fleet``: every record the user may read: the DAG ids the auth manager authorizes
  (``get_authorized_dag_ids``, as ``ReadableDagsFilterDep`` does) filter the query itself.

The user comes from the UI's ``_token`` cookie or a bearer token (Airflow's ``get_user``), so the
tab, an iframe of the same origin, is authorized as the UI is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any

from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.common.db.common import SessionDep
from airflow.api_fastapi.core_api.security import GetUserDep, requires_access_dag
from fastapi import Depends, FastAPI, HTTPException, Query, Request, status
from fastapi.responses import HTMLResponse
from sqlalchemy import func, select

from cancellable_agents.airflow._adapter import has_task_state_store
from cancellable_agents.airflow.cancellations_view._pages import (
    FleetQuery,
    StoredRow,
    fleet_page,
    task_instance_page,
)
from cancellable_agents.airflow.kill_record._stored import KEY_PREFIX

__all__ = ["FLEET_WINDOW", "PAGE_SIZE", "FleetFilter", "Records", "build_app"]

#: Records listed per page of the fleet view.
PAGE_SIZE = 50
#: The fleet's summaries are computed over at most this many records (the newest that match).
FLEET_WINDOW = 1000
#: A task instance shows at most this many tries.
TRIES_SHOWN = 50
#: No script, no outside fetch: a page is markup and inline style only.
_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; frame-ancestors 'self'"

_READ_TI = Depends(requires_access_dag(method="GET", access_entity=DagAccessEntity.TASK_INSTANCE))


@dataclass(frozen=True)
class FleetFilter:
    """The fleet page's filter, checked: the DAGs the user may read, and the optional DAG and
    time bounds."""

    readable: frozenset[str] | set[str]
    dag_id: str = ""
    since: datetime | None = None
    until: datetime | None = None


@dataclass(frozen=True)
class Records:
    """Where the stored records are, and the bounded queries of them: the task state store's
    table (Airflow 3.3+) or XCom's (3.1/3.2). Both have the task instance's columns, the key and
    the value; they differ in the time a row was written and whether a row has a narrow id."""

    model: Any
    #: The column of when a row was written.
    written: Any
    #: A narrow primary key to sort alone (the task state store's ``id``); XCom has none.
    id: Any = None

    @classmethod
    def here(cls) -> Records:
        """The records of this Airflow."""
        if has_task_state_store():
            from airflow.models.task_state_store import TaskStateStoreModel as Store

            return cls(Store, Store.updated_at, Store.id)
        from airflow.models.xcom import XComModel

        return cls(XComModel, XComModel.timestamp)

    def of_task_instance(
        self, session: Any, dag_id: str, run_id: str, task_id: str, map_index: int
    ) -> list[StoredRow]:
        """One task instance's records, newest first (at most ``TRIES_SHOWN``)."""
        model = self.model
        statement = (
            select(model.value)
            .where(
                model.dag_id == dag_id,
                model.run_id == run_id,
                model.task_id == task_id,
                model.map_index == map_index,
                model.key.startswith(KEY_PREFIX, autoescape=True),
            )
            .order_by(self.written.desc())
            .limit(TRIES_SHOWN)
        )
        return [
            StoredRow(dag_id, run_id, task_id, map_index, _document(v)) for v in session.scalars(statement)
        ]

    def of_fleet(
        self, session: Any, where: FleetFilter, page: int
    ) -> tuple[list[StoredRow], list[StoredRow], int]:
        """The newest ``FLEET_WINDOW`` records ``where`` matches (the summaries), the listed page
        (``PAGE_SIZE``, newest first) and how many match."""
        model = self.model
        conditions = [model.key.startswith(KEY_PREFIX, autoescape=True), model.dag_id.in_(where.readable)]
        if where.dag_id:
            conditions.append(model.dag_id == where.dag_id)
        if where.since is not None:
            conditions.append(self.written >= where.since)
        if where.until is not None:
            conditions.append(self.written <= where.until)
        total = session.scalar(select(func.count()).select_from(model).where(*conditions)) or 0
        window = self._newest(session, conditions, 0, FLEET_WINDOW)
        listed = self._newest(session, conditions, (page - 1) * PAGE_SIZE, PAGE_SIZE)
        return window, listed, total

    def _newest(self, session: Any, conditions: list[Any], offset: int, limit: int) -> list[StoredRow]:
        model = self.model
        columns = (model.dag_id, model.run_id, model.task_id, model.map_index, model.value)
        if self.id is None:  # XCom (3.1/3.2): one row per task instance, the latest try's
            statement = (
                select(*columns).where(*conditions).order_by(self.written.desc()).offset(offset).limit(limit)
            )
        else:
            # The ids are sorted alone (a narrow sort), then only those rows' values are read:
            # sorting whole rows made PostgreSQL sort every matching value (10,000 records: 13 MB)
            # per page.
            newest = select(self.id).where(*conditions).order_by(self.written.desc())
            ids = session.scalars(newest.offset(offset).limit(limit)).all()
            if not ids:
                return []
            statement = select(*columns).where(self.id.in_(ids)).order_by(self.written.desc())
        return [
            StoredRow(r.dag_id, r.run_id, r.task_id, r.map_index, _document(r.value))
            for r in session.execute(statement)
        ]


def build_app(url_prefix: str) -> FastAPI:
    """The app the plugin mounts at ``url_prefix`` (its pages link to each other under it)."""
    app = FastAPI(title="Cancellations", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.url_prefix = url_prefix
    app.state.records = Records.here()
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
    records: Records = request.app.state.records
    rows = records.of_task_instance(session, dag_id, run_id, task_id, index)
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
    where = FleetFilter(
        readable,
        dag_id,
        _instant(since, "since") if since else None,
        _instant(until, "until") if until else None,
    )
    records: Records = request.app.state.records
    window, listed, total = records.of_fleet(session, where, page)
    query = FleetQuery(dag_id=dag_id, since=since, until=until, page=page)
    return _html(
        fleet_page(
            window, listed, total, query, PAGE_SIZE, f"{request.app.state.url_prefix}/ti", FLEET_WINDOW
        )
    )


def _document(value: Any) -> dict[str, Any]:
    """A stored value as a document; one that does not parse shows as empty, not as an error.

    The task state store holds JSON text; XCom's JSON column holds the document itself, or (a value
    pushed through ``serialize_value``) its JSON text."""
    for _ in range(2):
        if not isinstance(value, str | bytes):
            break
        try:
            value = json.loads(value)
        except ValueError:
            return {}
    return value if isinstance(value, dict) else {}


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
