#!/usr/bin/env bash
# Install everything, then lint and run the whole test suite (the real-model tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# promtool (Debian's prometheus package) checks the /metrics output and exported rules when present.
if ! command -v promtool >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null) \
    || echo "note: promtool could not be installed; its checks will be skipped"
fi
.venv/bin/ruff check src tests benchmarks
.venv/bin/python -m pytest -q "$@"
