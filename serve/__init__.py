"""memfit serve: OpenAI-compatible generation server (see the serve issues)."""
