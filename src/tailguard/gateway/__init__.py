"""Traffic control in front of the engines: tenants and lanes bound to credentials, reserved capacity, routing over
upstream replicas, stream pacing and stall degradation (docs/gateway.md)."""
