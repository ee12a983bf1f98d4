#!/usr/bin/env bash
# Install everything, then lint and run the whole test suite (the real-model tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# Debian's packages for the tests that need real services: prometheus (promtool checks the /metrics output and the
# exported rules; a real Prometheus runs every Grafana panel's query), chromium (renders the HTML reports and the SLO
# dashboard), postgresql (the request store's tests start a throwaway server with initdb/pg_ctl, not the system
# service) and redis-server (the fleet's tests start a throwaway one the same way). Tests that need them say so and
# skip where they could not be installed (in CI they fail instead).
missing=""
command -v promtool >/dev/null 2>&1 || missing="$missing prometheus"
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
command -v pg_ctl >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || missing="$missing postgresql"
command -v redis-server >/dev/null 2>&1 || missing="$missing redis-server"
if [ -n "$missing" ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null) \
    || echo "note: could not install$missing; the checks that need them will be skipped"
fi
.venv/bin/ruff check src tests benchmarks
.venv/bin/python -m pytest -q "$@"
