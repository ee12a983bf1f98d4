"""tailguard bench: a load generator and latency profiler for OpenAI-compatible servers (see docs/bench.md)."""
