"""Light toolset descriptions: built once when a task runs, usable wherever a toolset is.

That building them costs a DAG file nothing is ``test_parse_time.py``'s (a fresh interpreter).
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.models.test import TestModel
from pydantic_ai.toolsets import FunctionToolset

from cancellable_agents.durable._fingerprint import tools_requiring_approval, walk_toolsets
from cancellable_agents.toolsets._toolset_description import ToolsetDescription, built

CALLS: list[str] = []


class Greeting(FunctionToolset[Any]):
    """A toolset with one tool, counting how often it is made."""

    made = 0

    def __init__(self, greeting: str, *, punctuation: str = "!") -> None:
        super().__init__()
        Greeting.made += 1
        self.greeting = greeting

        def greet(name: str) -> str:
            CALLS.append(name)
            return f"{greeting}, {name}{punctuation}"

        self.add_function(greet, name="greet")


class GreetingDescription(ToolsetDescription):
    toolset_class = f"{__name__}:Greeting"


def test_a_description_makes_its_toolset_once_on_first_use() -> None:
    Greeting.made = 0
    description = GreetingDescription("Hello", punctuation="?")
    assert Greeting.made == 0, "describing makes nothing"
    toolset = description.build()
    assert isinstance(toolset, Greeting) and description.build() is toolset and description(None) is toolset
    assert Greeting.made == 1
    assert description.greeting == "Hello", "what the description lacks, its toolset answers"
    assert built([description, "other"]) == [toolset, "other"]


def test_a_copy_describes_the_same_toolset_and_makes_its_own() -> None:
    description = GreetingDescription("Hi")
    first = description.build()
    clone = copy.deepcopy(description)
    assert repr(clone) == "GreetingDescription('Hi')"
    assert clone.build() is not first and clone.build().greeting == "Hi"


def test_an_agent_runs_a_description_it_was_given_directly() -> None:
    CALLS.clear()
    agent = Agent(TestModel(call_tools=["greet"]), toolsets=[GreetingDescription("Hello")])
    result = agent.run_sync("greet someone")
    assert CALLS, "the described tool ran"
    assert "Hello, " in str(result.all_messages())


def test_approval_checks_and_walks_never_make_a_described_toolset() -> None:
    Greeting.made = 0
    description = GreetingDescription("Hello")
    assert tools_requiring_approval(toolsets=[description]) == []
    assert list(walk_toolsets([description])) == [description]
    assert Greeting.made == 0
