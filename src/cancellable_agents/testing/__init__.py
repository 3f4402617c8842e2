"""Test helpers for cancellable_agents: a scripted, keyless, OpenAI-compatible model server
([`openai_server`][cancellable_agents.testing.openai_server]) and the sandbox backends'
conformance suite ([`sandbox_conformance`][cancellable_agents.testing.sandbox_conformance]: one
``sandbox_factory`` fixture runs the
[`Sandbox`][cancellable_agents.toolsets.sandbox.protocol.Sandbox] contract against any backend)."""
