"""The SLO sweep: the highest offered rate (open-loop arrivals) at which a profile still passes.

The rate grows geometrically from ``start`` until the profile fails (or ``max_rate``), then bisects between the last
passing and the first failing rate ``refine`` times. Each step is a fresh, seeded open-loop run of its own length;
the result is the full analysis of the best passing step, with every step summarised under ``sweep``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tailguard.bench.runner import BenchConfig, execute


def _summary(rate: float, res: dict, profile: str) -> dict:
    m = res["metrics"]

    def p(name: str, q: str):
        return ((m.get(name) or {}).get("percentiles") or {}).get(q, {}).get("value")

    v = res["slo"][profile]
    return {"rate": rate, "pass": bool(v["pass"]), "e2e_p50_s": p("e2e", "p50"), "e2e_p99_s": p("e2e", "p99"),
            "ttft_p99_s": p("ttft", "p99"), "goodput_rps": v.get("goodput_rps"),
            "achieved_rps": res["summary"]["throughput"]["requests_per_s"],
            "error_rate": res["summary"]["error_rate"],
            "failed": res["summary"]["requests"]["failed"],  # left out of the percentiles above, misses in the verdict
            "requests": res["summary"]["requests"]["completed"],  # the sample size behind this step's percentiles
            "failed_checks": [c["objective"] for c in v["checks"] if c["status"] == "fail"]}


async def sweep(cfg: BenchConfig, profile: str = "baseline", start: float = 1.0, max_rate: float = 1e4,
                factor: float = 2.0, refine: int = 3, max_steps: int = 20,
                on_step: Callable[[dict], None] | None = None) -> tuple[dict, list]:
    if start <= 0 or factor <= 1:
        raise ValueError("the sweep needs a positive start rate and a growth factor above 1")
    from tailguard.bench.profiles import load_profiles
    from tailguard.bench.tokens import load_tokenizer

    # ``profile`` is a built-in name or a YAML file; verdicts are keyed by the profile's name
    spec, profile = profile, load_profiles([profile])[0].name
    if spec not in cfg.profiles:
        cfg = dataclasses.replace(cfg, profiles=(*cfg.profiles, spec))

    tokenizer = load_tokenizer(cfg.tokenizer)
    steps: list[dict] = []
    best: tuple[dict, list] | None = None
    best_rate = None
    fail_rate = None

    async def step(rate: float) -> bool:
        nonlocal best, best_rate, fail_rate
        c = dataclasses.replace(cfg, rate=rate, concurrency=None, seed=cfg.seed + len(steps))
        res, ms = await execute(c, tokenizer=tokenizer, display=False)
        s = _summary(rate, res, profile)
        steps.append(s)
        if on_step is not None:
            on_step(s)
        if s["pass"]:
            if best_rate is None or rate > best_rate:
                best, best_rate = (res, ms), rate
        elif fail_rate is None or rate < fail_rate:
            fail_rate = rate
        return s["pass"]

    rate = start
    while len(steps) < max_steps and rate <= max_rate:
        if not await step(rate):
            break
        rate *= factor
    if best_rate is not None and fail_rate is not None:
        lo, hi = best_rate, fail_rate
        for _ in range(refine):
            if len(steps) >= max_steps:
                break
            mid = (lo * hi) ** 0.5
            if await step(mid):
                lo = mid
            else:
                hi = mid
    if best is None:  # nothing passed: report the lowest rate tried
        low = min(steps, key=lambda s: s["rate"])["rate"]
        c = dataclasses.replace(cfg, rate=low, concurrency=None)
        best = await execute(c, tokenizer=tokenizer, display=False)
    res, ms = best
    res["sweep"] = {"profile": profile, "best_rate": best_rate, "first_failing_rate": fail_rate, "steps": steps,
                    "note": ("highest offered rate at which the profile passed" if best_rate is not None else
                             f"the {profile} profile failed at every rate tried, down to {start:g} req/s")}
    return res, ms
