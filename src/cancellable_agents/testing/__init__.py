"""Test helpers for cancellable_agents: a scripted, keyless, OpenAI-compatible model server."""
