"""The live SLO page in headless Chromium: it loads, polls the monitor's data and shows the current tier."""

from __future__ import annotations

import shutil
import subprocess

import httpx
import pytest

from tailguard.slo.windows import RequestSample
from tests.serving_helpers import ADMIN_KEY
from tests.slo_helpers import FakeClock, slo_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _dump_dom(url: str, profile: str) -> str:
    out = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
         "--virtual-time-budget=3000", "--dump-dom", url],
        capture_output=True, text=True, timeout=90,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (Debian package 'chromium')")
def test_dashboard_shows_the_current_tier_in_chromium(tmp_path):
    clock = FakeClock()
    # With an API key the data is behind it; the page takes the key from its URL fragment.
    with slo_server(tmp_path, clock, api_key="dash-secret") as server:
        mon = server.state.slo
        clock.advance(1)
        for i in range(20):
            mon.record(RequestSample(e2e=1.2, ttft=0.3, queue_wait=0.9, request_id=f"slow{i}"))
        assert mon.evaluate().to_dict()["tier"] == "red"
        assert httpx.get(server.url + "/slo/data").status_code == 401
        assert httpx.get(server.url + "/slo").status_code == 200
        dom = _dump_dom(server.url + f"/slo?interval=500#key={ADMIN_KEY}", str(tmp_path / "chromium"))
    assert 'id="tier" class="t-red" data-tier="red">RED<' in dom
    assert "<title>tailguard SLO: RED</title>" in dom
    # The tables were filled from /slo/data: the scope row, the red alert and the degrade action.
    assert "all e2e" in dom and "alert tier_red" in dom and "action degrade" in dom
    assert "<polyline" in dom  # the time series was drawn
