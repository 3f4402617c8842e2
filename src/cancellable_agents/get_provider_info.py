"""Entry point for ``apache_airflow_provider``: the provider's metadata, read from provider.yaml."""

from __future__ import annotations

from importlib import resources
from typing import Any

import yaml


def get_provider_info() -> dict[str, Any]:
    """Return provider.yaml, the source of truth, as a fresh dict (Airflow mutates what it gets)."""
    text = resources.files("cancellable_agents").joinpath("provider.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)
