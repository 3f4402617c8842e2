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


@pytest.fixture(autouse=True)
def _known_gap(request: pytest.FixtureRequest) -> None:
    """Found by this suite: a command stopped before its wrapper (bubblewrap in namespace mode,
    the command's init in landlock mode) started it has only the wrapper's processes, which
    ``CommandTree`` leaves out of the record as plumbing, so the kill writes no record. Fixed in
    ``local/command.py``, these pass (not strict: a command the tracker saw first is recorded)."""
    for mode in ("namespace", "landlock"):
        if request.node.name == f"test_a_kill_is_recorded_on_the_scope[{mode}]":
            reason = f"{mode} mode writes no record for a command killed before its wrapper started it"
            request.applymarker(pytest.mark.xfail(reason=reason, strict=False))


class TestConformance(SandboxConformance):
    pass
