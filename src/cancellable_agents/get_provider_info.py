"""Entry point for ``apache_airflow_provider``: the provider's metadata, read from provider.yaml."""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

import yaml


@functools.cache
def get_provider_info() -> dict[str, Any]:
    """Return provider.yaml as a dict; it is the single source of truth for the metadata."""
    text = resources.files("cancellable_agents").joinpath("provider.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)
