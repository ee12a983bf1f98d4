#!/usr/bin/env bash
# Install everything, then lint and run the whole test suite (the real-model tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# Debian's packages for the tests that need real services: prometheus (promtool checks the /metrics output and the
# exported rules; a real Prometheus runs every Grafana panel's query), chromium (renders the HTML reports and the SLO
# dashboard), postgresql (the request store's tests start a throwaway server with initdb/pg_ctl, not the system
# service) and redis-server (the fleet's tests start a throwaway one the same way). Tests that need one skip where it
# could not be installed; with TAILGUARD_REQUIRE_SERVICES=1 (CI: .ci/run) they fail instead (tests/conftest.py).
missing_services() {
  local missing=""
  command -v promtool >/dev/null 2>&1 || missing="$missing prometheus"
  command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
  command -v pg_ctl >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || missing="$missing postgresql"
  command -v redis-server >/dev/null 2>&1 || missing="$missing redis-server"
  echo "$missing"
}
missing=$(missing_services)
if [ -n "$missing" ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "installing the test services:$missing (apt-get)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null) \
    || echo "note: apt-get could not install$missing"
  missing=$(missing_services)
fi
if [ -n "$missing" ]; then
  if [ "${TAILGUARD_REQUIRE_SERVICES:-}" = 1 ] || [ "${TAILGUARD_REQUIRE_PROMETHEUS:-}" = 1 ]; then
    echo "missing:$missing; TAILGUARD_REQUIRE_SERVICES=1, so the tests that need them will fail"
  else
    echo "note: missing:$missing; the tests that need them will be skipped (TAILGUARD_REQUIRE_SERVICES=1 fails them)"
  fi
fi
.venv/bin/ruff check src tests benchmarks
# The request path's floors type-check (engine, policy, backends, serving: [tool.mypy] in pyproject.toml).
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
