"""What the server sends a prepared request to: the ``Backend`` protocol (``base``), the embedded engine and the
scripted fake (both in ``tailguard.engine``), and upstream replicas over HTTP (``upstream``) (docs/architecture.md)."""
