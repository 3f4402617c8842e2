"""TaskFlow decorators ``@task.llm`` and ``@task.agent`` (registered through provider.yaml)."""
