"""A shed request is refused with the configured status and a Retry-After in whole seconds, at least 1 and at most a
day, whatever figure reaches the policy: an infinite one (a monitor built from a config that was never validated)
once made every shed request a 500, and those 500s then fed the error-rate SLO."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tailguard.api_error import APIError
from tailguard.observe.timeline import Timeline
from tailguard.policy.decision import Decision, TrafficPolicy


class ShedAll:
    """The monitor's per-request question, answered "shed" with a given Retry-After."""

    def __init__(self, retry_after_s: float) -> None:
        self.retry_after_s = retry_after_s

    def shed_for(self, business_type: str | None, lane: str | None = None,
                 tenant: str | None = None) -> dict[str, Any]:
        return {"action": "shed", "tier": "orange", "scope": "all", "action_id": "a1", "status": 429,
                "retry_after_s": self.retry_after_s}


@pytest.mark.parametrize("seconds, header", [
    (30.0, "30"), (0.2, "1"), (0.0, "1"), (1e300, "86400"), (math.inf, "86400"), (math.nan, "1"),
])
def test_a_shed_request_gets_a_bounded_retry_after(seconds, header):
    policy = TrafficPolicy(None, None, ShedAll(seconds), None,  # type: ignore[arg-type] - no lanes, no shared state
                           default_lane="default", trust_lane_header=False)
    tl = Timeline(request_id="r1", endpoint="/v1/chat/completions")
    with pytest.raises(APIError) as exc:
        policy.shed(Decision(), tl, "batch")
    assert exc.value.status == 429 and exc.value.headers == {"Retry-After": header}
    assert f"retry in {header} s" in exc.value.message
    assert tl.slo_action == {"action": "shed", "tier": "orange", "scope": "all", "action_id": "a1"}


def test_retry_after_header_rounds_up():
    from tailguard.policy.decision import retry_after_header

    assert retry_after_header(29.1) == 30 and retry_after_header(-5) == 1
