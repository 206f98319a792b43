"""Structured output: the grammar compiler, its worker process, the JSON-schema policy."""
