"""The public conformance suite (``cancellable_agents.testing.sandbox_conformance``) against the
backends this project ships and tests: :class:`LocalSandbox` in each isolation mode (a mode this
machine lacks is skipped, with the reason) and the helper backend (commands in a separate
process, pids unknown to the task: what a remote backend looks like). One fixture, as a
backend author writes it (``docs/content/sandbox.md``)."""

from __future__ import annotations

import pytest

from cancellable_agents.testing.sandbox_conformance import SandboxConformance, SandboxFactory
from cancellable_agents.toolsets.sandbox import LocalSandbox
from tests.process.helper_backend import HelperSandbox
from tests.process.trees import MODES

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]


@pytest.fixture(params=[*MODES, "helper"])
def sandbox_factory(request: pytest.FixtureRequest) -> SandboxFactory:
    if request.param == "helper":
        return HelperSandbox
    return lambda: LocalSandbox(isolation=request.param, stop_grace=0.5)


class TestConformance(SandboxConformance):
    pass
