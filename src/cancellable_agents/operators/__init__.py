"""Operators of the provider: ``LLMOperator`` and ``AgentOperator``."""
