"""Provider metadata, the connection type, the hook, and the TaskFlow decorators."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import yaml

from cancellable_agents.core.exceptions import ConfigurationError
from cancellable_agents.get_provider_info import (
    NAMES_SHARED_WITH_COMMON_AI,
    common_ai_installed,
    get_provider_info,
)
from cancellable_agents.hooks.model import ModelHook, build_model
from cancellable_agents.testing.openai_server import ScriptedModelServer
from tests.airflow_versions import AIRFLOW_VERSION, has_retry_policies, major_minor

ROOT = Path(__file__).parents[2]
PACKAGE_NAME = "airflow-provider-cancellable-agents"


def test_provider_info_is_provider_yaml() -> None:
    expected = yaml.safe_load((ROOT / "provider.yaml").read_text())
    if common_ai_installed():  # common.ai keeps @task.llm / @task.agent (test_decorator_names.py)
        expected["task-decorators"] = [
            d for d in expected["task-decorators"] if d["name"] not in NAMES_SHARED_WITH_COMMON_AI
        ]
    assert get_provider_info() == expected


def test_provider_info_passes_airflows_own_schema() -> None:
    import importlib.resources

    import jsonschema

    schema_file = importlib.resources.files("airflow").joinpath("provider_info.schema.json")
    schema = json.loads(schema_file.read_text())
    jsonschema.validate(get_provider_info(), schema)


def test_the_config_section_is_the_one_the_code_reads() -> None:
    """provider.yaml declares ``[cancellable_agents]`` (``airflow config list`` shows it); the code
    reads :data:`OPTIONS`: the same names, types and defaults."""
    from cancellable_agents.airflow.config import OPTIONS, SECTION

    declared = get_provider_info()["config"][SECTION]["options"]
    assert sorted(declared) == sorted(OPTIONS)
    for name, option in OPTIONS.items():
        kind = {"float": float, "boolean": bool}[declared[name]["type"]]
        default = declared[name]["default"]
        parsed = default == "True" if kind is bool else float(default)
        assert (kind, parsed) == (option.kind, option.default), name


def test_the_providers_page_links_to_the_documentation() -> None:
    """Airflow's *Providers* page shows ``documentation-url`` as the provider's link."""
    from airflow.providers_manager import ProvidersManager

    info = ProvidersManager().providers["airflow-provider-cancellable-agents"].data
    # Airflow 3.1/3.2 keep the space after the comma of "Project-URL: Documentation, <url>" (a
    # browser ignores it in a link); 3.3 strips it.
    assert str(info["documentation-url"]).strip().startswith("https://")


def test_entry_point_returns_the_provider_info() -> None:
    (ep,) = [
        e for e in entry_points(group="apache_airflow_provider") if e.value.startswith("cancellable_agents")
    ]
    assert ep.load()()["package-name"] == "airflow-provider-cancellable-agents"


def _task_runtime_registry() -> Any:
    """Where a running task looks up hooks and TaskFlow decorators: the Task SDK's own manager
    from Airflow 3.2, airflow-core's ``ProvidersManager`` on 3.1 (one manager served both)."""
    try:
        from airflow.sdk.providers_manager_runtime import ProvidersManagerTaskRuntime
    except ImportError:
        from airflow.providers_manager import ProvidersManager

        return ProvidersManager()
    return ProvidersManagerTaskRuntime()


def test_airflow_registers_the_connection_type_hook_and_decorators() -> None:
    from airflow.providers_manager import ProvidersManager

    runtime = _task_runtime_registry()
    assert "cancellable_agents_model" in runtime.hooks
    assert {"llm", "agent", "cancellable_llm", "cancellable_agent"} <= set(runtime.taskflow_decorators)
    manager = ProvidersManager()
    assert "airflow-provider-cancellable-agents" in manager.providers
    if major_minor(AIRFLOW_VERSION) < (3, 2):
        return  # 3.1 reads the form from the hook, and only with FAB: see the UI test below
    behaviour = manager.field_behaviours["cancellable_agents_model"]
    assert behaviour["relabeling"] == {"schema": "Model id", "host": "Base URL", "password": "API key"}
    assert set(behaviour["hidden_fields"]) == {"login"}  # Port: Airflow 3.3.1-3.3.2's Test button


UI_HOOK_META = """
from airflow.api_fastapi.core_api.services.ui.connections import HookMetaService
(meta,) = [m for m in HookMetaService.hook_meta_data() if m.connection_type == "cancellable_agents_model"]
print("RESULT " + meta.model_dump_json())
"""


def test_the_ui_connection_form_has_the_model_field_and_labels() -> None:
    """What the API server sends the UI's connection form, on every supported Airflow: 3.2+ builds
    it from provider.yaml, 3.1 from the hook's methods. A fresh interpreter, because the service
    stands in for FAB by patching ``sys.modules``."""
    proc = subprocess.run(
        [sys.executable, "-c", UI_HOOK_META], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT ") :])
    fields = meta["standard_fields"]
    titles = [fields[name]["title"] for name in ("url_schema", "host", "password")]
    assert titles == ["Model id", "Base URL", "API key"]
    assert fields["login"]["hidden"]
    assert not fields["port"]["hidden"], "Airflow 3.3.1-3.3.2's Test button needs a stored port"
    assert not fields["url_schema"]["hidden"], "the model id must be visible, not under Extra Fields"
    # The form cuts placeholders at its width (~40 characters at the default window size).
    assert all(
        len(fields[name]["placeholder"] or "") <= 40 for name in ("url_schema", "host", "password", "port")
    )
    assert not meta["extra_fields"], "one place for the model id"


def test_task_decorators_build_our_operators() -> None:
    from airflow.sdk import DAG, task

    from cancellable_agents import AgentOperator, LLMOperator

    with DAG("decorators", schedule=None):

        @task.cancellable_llm(model="test")
        def ask(topic: str) -> str:
            return f"Tell me about {topic}"

        @task.cancellable_agent(model="test")
        def investigate() -> str:
            return "Investigate"

        llm = ask("otters")
        agent = investigate()
    assert isinstance(llm.operator, LLMOperator)
    assert isinstance(agent.operator, AgentOperator)
    assert "prompt" in llm.operator.template_fields


def test_cli_lists_the_provider(tmp_path: Path) -> None:
    env = {"AIRFLOW_HOME": str(tmp_path), "PATH": str(Path(sys.executable).parent)}
    out = subprocess.run(
        [sys.executable, "-m", "airflow", "providers", "list", "--output", "json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    names = [p["package_name"] for p in json.loads(out[out.index("[") :])]
    assert "airflow-provider-cancellable-agents" in names


def test_test_model_needs_no_key() -> None:
    from pydantic_ai.models.test import TestModel

    assert isinstance(build_model("test"), TestModel)


def test_base_url_makes_an_openai_compatible_model() -> None:
    from pydantic_ai.models.openai import OpenAIChatModel

    model = build_model("openai:llama3.2", base_url="http://127.0.0.1:11434/v1")
    assert isinstance(model, OpenAIChatModel)
    assert model.model_name == "llama3.2"
    assert str(model.client.base_url).startswith("http://127.0.0.1:11434/v1")


def test_anthropic_with_a_key() -> None:
    from pydantic_ai.models.anthropic import AnthropicModel

    assert isinstance(build_model("anthropic:claude-sonnet-4-5", api_key="sk-test"), AnthropicModel)


def test_bad_model_id_names_the_fix() -> None:
    with pytest.raises(ConfigurationError, match="provider:name"):
        build_model("no-such-provider:whatever")


def test_connection_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic_ai.models.openai import OpenAIChatModel

    conn = {
        "conn_type": "cancellable_agents_model",
        "host": "http://127.0.0.1:8000/v1",
        "password": "sk-local",
        "extra": {"model": "openai:qwen"},
    }
    monkeypatch.setenv("AIRFLOW_CONN_MY_LLM", json.dumps(conn))
    model = ModelHook(llm_conn_id="my_llm").get_model()
    assert isinstance(model, OpenAIChatModel) and model.model_name == "qwen"
    overridden = ModelHook(llm_conn_id="my_llm", model="openai:other").get_model()
    assert overridden.model_name == "other"


def test_model_id_field_wins_over_the_old_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    conn = {
        "conn_type": "cancellable_agents_model",
        "host": "http://127.0.0.1:8000/v1",
        "schema": "openai:new",
        "extra": {"model": "openai:old"},
    }
    monkeypatch.setenv("AIRFLOW_CONN_MY_LLM", json.dumps(conn))
    assert ModelHook(llm_conn_id="my_llm").get_model().model_name == "new"


def test_the_test_button_asks_an_openai_compatible_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """The form's *Test* (``Connection.test_connection`` calls the hook's): a real request."""
    from airflow.models.connection import Connection

    with ScriptedModelServer() as server:
        conn = Connection(
            conn_id="my_llm", conn_type="cancellable_agents_model", host=server.base_url, schema="openai:echo"
        )
        monkeypatch.setenv("AIRFLOW_CONN_MY_LLM", conn.as_json())
        ok, message = conn.test_connection()
        assert ok, message
        assert "echo: Reply with: ok" in message
        assert [r.model for r in server.requests] == ["echo"]

        monkeypatch.setenv(
            "AIRFLOW_CONN_MY_LLM", json.dumps({**json.loads(conn.as_json()), "schema": "openai:nope"})
        )
        ok, message = ModelHook(llm_conn_id="my_llm").test_connection()
        assert not ok and "400" in message and "nope" in message, message


def test_the_test_button_runs_the_test_model_locally(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "AIRFLOW_CONN_MY_LLM", json.dumps({"conn_type": "cancellable_agents_model", "schema": "test"})
    )
    ok, message = ModelHook(llm_conn_id="my_llm").test_connection()
    assert ok and "'test'" in message, message


def test_the_test_button_says_why_it_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    conn = {"conn_type": "cancellable_agents_model", "host": "http://127.0.0.1:9/v1", "schema": "openai:x"}
    monkeypatch.setenv("AIRFLOW_CONN_MY_LLM", json.dumps(conn))
    ok, message = ModelHook(llm_conn_id="my_llm").test_connection()
    assert not ok and "Connection" in message, message


def test_unknown_connection_names_the_fix() -> None:
    with pytest.raises(ConfigurationError, match="airflow connections add nope"):
        ModelHook(llm_conn_id="nope").get_model()


def test_missing_model_id_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_EMPTY", json.dumps({"conn_type": "cancellable_agents_model"}))
    with pytest.raises(ConfigurationError, match="Model id"):
        ModelHook(llm_conn_id="empty").get_model()


def test_the_package_is_typed_and_its_lazy_exports_are_visible_to_type_checkers() -> None:
    """A user's mypy sees every export with its type (not ``Any``): ``py.typed`` ships with the
    package and the ``TYPE_CHECKING`` imports name exactly the lazy table's modules."""
    import ast

    import cancellable_agents

    package = Path(cancellable_agents.__file__).parent
    assert (package / "py.typed").is_file()
    tree = ast.parse((package / "__init__.py").read_text())
    guarded = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
    )
    seen = {
        alias.name: node.module
        for node in guarded.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert seen == cancellable_agents._EXPORTS
    needs_3_3 = set() if has_retry_policies() else {"CancellationAwareRetryPolicy"}  # refused below 3.3
    for name in sorted(set(cancellable_agents.__all__) - needs_3_3):
        assert getattr(cancellable_agents, name) is not None


def test_the_providers_errors_have_one_base_and_a_kill_is_not_one() -> None:
    from cancellable_agents import CancellableAgentsError, ConfigurationError, TaskCancelled
    from cancellable_agents.durable._pauses import ApprovalNotPossible
    from cancellable_agents.toolsets.sandbox import SandboxClosed, SandboxError, SandboxUnavailable

    for error in (ConfigurationError, SandboxError, SandboxUnavailable, SandboxClosed, ApprovalNotPossible):
        assert issubclass(error, CancellableAgentsError), error
    assert not issubclass(TaskCancelled, CancellableAgentsError), "catching them never swallows a kill"
    with pytest.raises(ConfigurationError, match="isolation must be"):  # a misconfiguration is one class
        from cancellable_agents.toolsets.sandbox import LocalSandbox

        LocalSandbox(isolation="sideways")  # type: ignore[arg-type]


#: The rooms that may import Airflow (tests/unit/test_layers.py), so the only ones that can define
#: a trigger (an Airflow ``BaseTrigger``); ``common_ai`` needs its optional extra and defines none.
TRIGGER_ROOMS = ("airflow", "operators", "decorators", "hooks")


#: Modules that cannot import below Airflow 3.3: retry policies are 3.3's (it refuses, naming the
#: upgrade). The Cancellations view's app imports everywhere (it reads XCom before 3.3).
NEEDS_3_3_MODULES = frozenset() if has_retry_policies() else frozenset({"cancellable_agents.airflow.retry"})


def _trigger_classes() -> set[type]:
    """Every trigger class the package defines, found by importing the rooms that may hold one."""
    import importlib
    import pkgutil

    from airflow.triggers.base import BaseTrigger

    for room in TRIGGER_ROOMS:
        package = importlib.import_module(f"cancellable_agents.{room}")
        for module in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if module.name not in NEEDS_3_3_MODULES:
                importlib.import_module(module.name)
    found: set[type] = set()
    todo: list[type] = [BaseTrigger]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("cancellable_agents."):
                found.add(sub)
    return found


def test_provider_yaml_declares_every_trigger_the_package_ships() -> None:
    declared = {
        module for entry in get_provider_info().get("triggers", ()) for module in entry["python-modules"]
    }
    shipped = _trigger_classes()
    assert {"PollTrigger", "DeferredCallsTrigger", "HttpJobTrigger"} <= {cls.__name__ for cls in shipped}
    assert {cls.__module__ for cls in shipped} == declared


def test_airflow_lists_the_declared_triggers() -> None:
    from airflow.providers_manager import ProvidersManager

    ours = {t.trigger_class_name for t in ProvidersManager().trigger if t.package_name == PACKAGE_NAME}
    assert ours == {"cancellable_agents.airflow.triggers", "cancellable_agents.airflow.http_job"}


def test_the_license_ships_with_the_package() -> None:
    """pyproject names the license file (PEP 639), so the wheel and the sdist carry it."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


#: The documented import paths (docs/content/versioning.md, "The public API") beside the modules
#: the package root exports from.
DOCUMENTED_MODULES = (
    "cancellable_agents.operators.llm",
    "cancellable_agents.operators.agent",
    "cancellable_agents.decorators.llm_task",
    "cancellable_agents.decorators.agent_task",
    "cancellable_agents.hooks.model",
    "cancellable_agents.common_ai",
    "cancellable_agents.toolsets.sandbox",
    "cancellable_agents.durable",
    "cancellable_agents.testing.openai_server",
    "cancellable_agents.testing.jobs",
    "cancellable_agents.airflow.kill_record.document",
)


def test_every_public_module_says_what_it_exports() -> None:
    import importlib

    import cancellable_agents

    exported_from: dict[str, set[str]] = {}
    for name, module in cancellable_agents._EXPORTS.items():
        exported_from.setdefault(module, set()).add(name)
    for module_name in sorted({*exported_from, *DOCUMENTED_MODULES}):
        if module_name == "cancellable_agents.common_ai" and not common_ai_installed():
            continue
        if module_name in NEEDS_3_3_MODULES:
            continue
        module = importlib.import_module(module_name)
        declared = getattr(module, "__all__", None)
        assert declared is not None, f"{module_name} has no __all__"
        assert [name for name in declared if not hasattr(module, name)] == [], module_name
        assert exported_from.get(module_name, set()) <= set(declared), module_name


def test_the_cancellations_view_is_offered_on_every_supported_airflow() -> None:
    """A tab and a nav page, served by one app, on 3.3+ and on 3.1/3.2 (the compat venvs run
    this): its app reads the task state store there, XCom here."""
    from cancellable_agents.airflow._adapter import has_task_state_store
    from cancellable_agents.airflow.cancellations_view._plugin import CancellationsPlugin

    views = CancellationsPlugin.external_views
    assert [view["destination"] for view in views] == ["task_instance", "nav"]
    (app,) = CancellationsPlugin.fastapi_apps
    table = app["app"].state.records.model.__tablename__
    assert table == ("task_state_store" if has_task_state_store() else "xcom"), table
