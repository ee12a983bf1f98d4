"""Observability: the per-request timeline, Prometheus metrics, the request store and redaction.

Nothing here knows the engine's internals: records are built from timestamps the server and the engine hand over.
"""
