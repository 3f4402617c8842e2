"""The pydantic-ai binding: runs an agent under a scope (tracking, tool threads, wrappers)."""
