"""The OpenAI-compatible HTTP server: the app and its routes, the completion endpoint and the exchange it runs, the
server's state and lifespan (docs/architecture.md)."""
