"""Entry point for ``apache_airflow_provider``: the provider's metadata, read from provider.yaml."""

from __future__ import annotations

from importlib import metadata, resources
from typing import Any

import yaml

#: TaskFlow names that apache-airflow-providers-common-ai registers too. Airflow keeps the first
#: registration it meets (and warns on every parse), so with both installed an existing common.ai
#: DAG's ``@task.llm`` would silently become ours. Where common.ai is installed these names stay
#: common.ai's; ``@task.cancellable_llm`` / ``@task.cancellable_agent`` always name ours.
NAMES_SHARED_WITH_COMMON_AI = frozenset({"llm", "agent"})


def get_provider_info() -> dict[str, Any]:
    """Return provider.yaml, the source of truth, as a fresh dict (Airflow mutates what it gets),
    without the decorator names common.ai owns where common.ai is installed."""
    text = resources.files("cancellable_agents").joinpath("provider.yaml").read_text(encoding="utf-8")
    info: dict[str, Any] = yaml.safe_load(text)
    if common_ai_installed():
        info["task-decorators"] = [
            d for d in info["task-decorators"] if d["name"] not in NAMES_SHARED_WITH_COMMON_AI
        ]
    return info


def common_ai_installed() -> bool:
    """Whether apache-airflow-providers-common-ai is installed in this environment."""
    try:
        metadata.distribution("apache-airflow-providers-common-ai")
    except metadata.PackageNotFoundError:
        return False
    return True
