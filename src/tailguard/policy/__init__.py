"""Traffic policy, the same in front of the embedded engine and of upstream replicas: who the caller is (API key ->
tenant -> lane -> priority), rate limits, lanes with reserved and burst capacity, and the state several gateways
share. Nothing here talks HTTP or runs a model (docs/architecture.md)."""
