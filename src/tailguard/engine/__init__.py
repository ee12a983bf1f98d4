"""The embedded engine: a Llama-family model served with continuous batching over a paged KV cache.

Floors inside: ``blocks`` and ``scheduler`` are plain Python (no torch); ``runner`` and ``model`` own all tensor work;
``engine`` runs the step loop (schedule -> run -> post-process) and the async front.
"""
