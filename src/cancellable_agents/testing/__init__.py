"""Test helpers for cancellable_agents: a scripted, keyless, OpenAI-compatible model server
(:mod:`.openai_server`) and the sandbox backends' conformance suite (:mod:`.sandbox_conformance`:
one ``sandbox_factory`` fixture runs the :class:`~cancellable_agents.toolsets.sandbox.Sandbox`
contract against any backend)."""
