"""The server's HTTP endpoints, one module per concern (the completions endpoint is ``serving/endpoint.py``)."""
