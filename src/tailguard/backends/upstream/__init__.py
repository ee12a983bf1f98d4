"""Upstream replicas (vLLM, SGLang, llama.cpp, another tailguard) over HTTP/1.1: the connection pool and client
(``http1``), the replica set with health, breakers and routing (``pool``), the backend that sends a request and reads
its SSE answer (``proxy``, ``sse``), the direct relay of plain tokens (``relay``), the quarantine of requests that
kill replicas, and a stalled stream continued on another replica (``fallback``)."""
