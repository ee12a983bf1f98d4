"""One bench run from configuration to results: workload, load, join, metrics, verdicts, outputs."""

from __future__ import annotations

import asyncio
import os
import platform
import secrets
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from tailguard.bench import arrivals
from tailguard.bench.client import Endpoint, make_transport
from tailguard.bench.loadgen import LoadOutcome, LoadPlan, RequestOptions, probe, run_load
from tailguard.bench.metrics import aggregate, local_output_counts, request_metrics
from tailguard.bench.profiles import evaluate, golden_rules, load_profiles, slowest
from tailguard.bench.redact import command_line, redact_url, scrub, secret_values
from tailguard.bench.results import SCHEMA, samples
from tailguard.bench.stages import fetch_records, split_request, stage_report, timing_error
from tailguard.bench.tokens import load_tokenizer, tokenization_cost
from tailguard.bench.workloads import JsonlWorkload, RequestSpec, SyntheticWorkload, TraceWorkload


@dataclass
class BenchConfig:
    url: str
    model: str = "default"
    endpoint: str = "chat"  # chat | completions
    stream: bool = True
    api_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    # load
    concurrency: int | None = None
    rate: float | None = None
    arrival: str = "poisson"  # poisson | gamma | constant
    burstiness: float = 1.0
    num_requests: int | None = None
    duration: float | None = None
    warmup_requests: int = 0
    warmup_seconds: float = 0.0
    max_inflight: int = 10_000
    timeout: float = 600.0
    drain_timeout: float | None = None
    # workload
    workload: str = "synthetic"  # synthetic | long | jsonl | trace
    input_tokens: int = 256
    output_tokens: int = 128
    input_spread: float = 0.0
    output_spread: float = 0.0
    langs: tuple[str, ...] = ("en",)
    jsonl: str | None = None
    trace: str | None = None
    trace_speedup: float = 1.0
    length_scale: float = 1.0
    trace_start: float = 0.0
    trace_duration: float | None = None
    trace_window: str | None = None  # --window as given (busiest:600): trace_start/trace_duration hold what it chose
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    business_type: str | None = None
    # request options
    fixed_output: bool = True
    continuous_usage: bool = False
    temperature: float | None = 0.0
    # analysis
    profiles: tuple[str, ...] = ("baseline", "advanced", "strict")
    seed: int = 0
    bootstrap: int = 1000
    http_client: str = "aiohttp"
    join: str = "auto"  # auto | fetch | off
    join_max: int = 2000
    tokenizer: str = "auto"
    probe: bool = True
    output_dir: str | None = None
    progress: bool = True
    label: str | None = None
    failures_as_timeout: bool = False  # failed requests enter TTFT/E2E percentiles at ``timeout``
    # traffic classes (bench/classes.py: TrafficClass); none: one class, as before
    classes: tuple[Any, ...] = ()
    class_column: str | None = None  # a trace column naming each request's class (instead of shares)

    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"


def build_workload(cfg: BenchConfig, tokenizer):
    base = _build_base_workload(cfg, tokenizer)
    if not cfg.classes:
        return base
    from tailguard.bench.classes import ClassedWorkload

    by_column = bool(cfg.class_column)
    if by_column:
        if not isinstance(base, TraceWorkload):
            raise ValueError("a class column is read from a replayed trace (--workload trace)")
        names = {c.name for c in cfg.classes}
        unknown = sorted({r.cls for r in base.rows if r.cls not in names}, key=str)
        if unknown:
            raise ValueError(f"the trace's {cfg.class_column!r} column names classes that no class defines: "
                             f"{', '.join(map(str, unknown[:5]))} (defined: {', '.join(sorted(names))})")
    own = {}
    for c in cfg.classes:
        if c.own_prompts:  # synthetic prompts of the class's own lengths and languages
            own[c.name] = SyntheticWorkload(
                tokenizer, input_tokens=c.prompt_tokens or cfg.input_tokens,
                output_tokens=c.output_tokens or cfg.output_tokens, langs=tuple(c.langs or cfg.langs),
                input_spread=cfg.input_spread if c.input_spread is None else c.input_spread,
                output_spread=cfg.output_spread if c.output_spread is None else c.output_spread,
                long_context=cfg.workload == "long", seed=cfg.seed, business_type=c.business_type or cfg.business_type)
    return ClassedWorkload(base, list(cfg.classes), seed=cfg.seed, by_column=by_column, own=own)


def _base(workload):
    """The workload under the traffic classes, if any (what decides the arrival schedule)."""
    return getattr(workload, "base", workload)


def run_secrets(cfg: BenchConfig) -> list[str]:
    """Every value that must appear in no output: the run's key and credentials, and each class's."""
    hidden = secret_values(cfg.api_key, cfg.headers, cfg.url)
    if cfg.classes:
        from tailguard.bench.classes import class_secrets

        hidden = sorted(set(hidden) | set(class_secrets(cfg.classes)), key=len, reverse=True)
    return hidden


def _build_base_workload(cfg: BenchConfig, tokenizer):
    if cfg.workload == "jsonl" or cfg.jsonl:
        if not cfg.jsonl:
            raise ValueError("--workload jsonl needs --jsonl PATH")
        return JsonlWorkload(Path(cfg.jsonl), default_max_tokens=cfg.output_tokens, seed=cfg.seed)
    if cfg.workload == "trace" or cfg.trace:
        return TraceWorkload(tokenizer, source=cfg.trace or "conv", speedup=cfg.trace_speedup,
                             length_scale=cfg.length_scale, start=cfg.trace_start, duration=cfg.trace_duration,
                             max_input_tokens=cfg.max_input_tokens, max_output_tokens=cfg.max_output_tokens,
                             lang=cfg.langs[0], seed=cfg.seed, class_column=cfg.class_column if cfg.classes else None)
    return SyntheticWorkload(tokenizer, input_tokens=cfg.input_tokens, output_tokens=cfg.output_tokens,
                             langs=tuple(cfg.langs), input_spread=cfg.input_spread, output_spread=cfg.output_spread,
                             long_context=cfg.workload == "long", seed=cfg.seed, business_type=cfg.business_type)


def build_plan(cfg: BenchConfig, workload) -> LoadPlan:
    plan = LoadPlan(num_requests=cfg.num_requests, duration=cfg.duration, warmup_requests=cfg.warmup_requests,
                    warmup_seconds=cfg.warmup_seconds, max_inflight=cfg.max_inflight,
                    drain_timeout=cfg.drain_timeout)
    workload = _base(workload)
    if isinstance(workload, TraceWorkload):
        plan.mode = "open"
        offsets = np.asarray(workload.offsets())
        if cfg.rate:  # a target mean rate overrides the speed-up
            offsets = offsets * (workload.trace_rate() * workload.speedup / cfg.rate)
        plan.offsets = offsets
        if plan.num_requests is None and plan.duration is None:
            plan.num_requests = len(offsets)
        return plan
    if plan.num_requests is None and plan.duration is None:
        plan.num_requests = 100
    if cfg.rate:
        plan.mode = "open"
        plan.offsets = arrivals.schedule(cfg.arrival, cfg.rate, n=cfg.num_requests, duration=cfg.duration,
                                         seed=cfg.seed, burstiness=cfg.burstiness)
    else:
        plan.mode = "closed"
        plan.concurrency = cfg.concurrency or 1
    return plan


class _Display:
    """rich progress bar with live P50/P99 (off when not a terminal or --quiet)."""

    def __init__(self, enabled: bool, total: int | None, duration: float | None, label: str) -> None:
        self.enabled = enabled
        self.progress = None
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.total = total
        self.duration = duration
        from rich.console import Console

        # on stderr, so that stdout keeps only the summary (scripts may parse it)
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[stats]}"), transient=False,
                                 console=Console(stderr=True))
        self.task = self.progress.add_task(label, total=total or (duration or 1) * 1.0, stats="")

    def __enter__(self):
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()

    def tick(self, prog, elapsed: float) -> None:
        if self.progress is None:
            return
        stats = f"sent {prog.sent}  done {prog.done}  errors {prog.errors}"
        if prog.recent_e2e:
            e = np.asarray(prog.recent_e2e[-1000:])
            stats += f"  E2E p50 {np.percentile(e, 50) * 1e3:.0f} ms p99 {np.percentile(e, 99) * 1e3:.0f} ms"
        if prog.recent_ttft:
            t = np.asarray(prog.recent_ttft[-1000:])
            stats += f"  TTFT p99 {np.percentile(t, 99) * 1e3:.0f} ms"
        completed = prog.done if self.total else min(elapsed, self.duration or elapsed)
        self.progress.update(self.task, completed=completed, stats=stats)


async def execute(cfg: BenchConfig, workload=None, tokenizer=None, plan: LoadPlan | None = None,
                  display: bool | None = None, transport=None, on_tick=None,
                  after_load: Callable[[], Awaitable[Any]] | None = None) -> tuple[dict, list]:
    """Run the bench; returns (results dict, per-request metrics).

    ``transport`` replaces the HTTP client (an object with the ``client._Transport`` methods): tests replay scripted
    streams through it without a socket. ``on_tick(progress, elapsed)`` receives the progress instead of the bar
    (a caller that draws its own); ``after_load`` is awaited once the load and the stage join are over, before the
    analysis (``bench ab`` reads a gateway's replica-seconds there, so that they cover the load and nothing else).
    """
    tokenizer = tokenizer or load_tokenizer(cfg.tokenizer)
    workload = workload or build_workload(cfg, tokenizer)
    plan = plan or build_plan(cfg, workload)
    run_id = "tgb-" + secrets.token_hex(4)
    headers = dict(cfg.headers)
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    ep = Endpoint(cfg.url, cfg.path(), headers, cfg.timeout)
    opts = RequestOptions(model=cfg.model, stream=cfg.stream, fixed_output=cfg.fixed_output,
                          continuous_usage=cfg.continuous_usage, temperature=cfg.temperature, headers=headers,
                          class_headers=workload.headers_by_class() if hasattr(workload, "headers_by_class") else {})
    transport = transport or make_transport(cfg.http_client)
    max_conn = plan.concurrency if plan.mode == "closed" else plan.max_inflight
    await transport.start(max(1, max_conn) + 8, cfg.timeout)
    try:
        caps: dict[str, Any] = {}
        if cfg.probe:
            s0 = workload.spec(0)
            probe_spec = RequestSpec(prompt=s0.prompt, messages=s0.messages, max_tokens=min(4, s0.max_tokens),
                                     lang=s0.lang, traffic_class=s0.traffic_class)
            caps = await probe(transport, ep, opts, probe_spec)
            if not caps.get("ok"):
                hidden = run_secrets(cfg)
                raise ConnectionError(f"the server at {redact_url(ep.full_url)} did not answer the probe request: "
                                      f"{scrub(str(caps.get('error')), hidden)}")
        total = plan.num_requests if plan.mode == "closed" else (
            min(len(plan.offsets), plan.num_requests or len(plan.offsets)) if plan.duration is None else None)
        show = display if display is not None else (cfg.progress and sys.stderr.isatty())
        with _Display(show and on_tick is None, total, plan.duration, f"bench {workload.name}") as disp:
            outcome = await run_load(transport, ep, workload, plan, opts, run_id, on_tick=on_tick or disp.tick,
                                     capabilities=caps)
        local = local_output_counts(outcome.results, tokenizer)
        ms = [request_metrics(r, outcome.t0, tokenizer, c) for r, c in zip(outcome.results, local)]
        join_info: dict[str, Any] = {"mode": cfg.join}
        pairs = list(zip(ms, outcome.results))
        if cfg.join != "off":
            have_stream_stages = any(r.tailguard or r.server_timing for r in outcome.results)
            if cfg.join == "fetch" or not have_stream_stages:
                measured_pairs = [(m, r) for m, r in pairs if not m.warmup]
                join_info["fetch"] = await fetch_records(transport, cfg.url, measured_pairs, cfg.join_max, cfg.seed,
                                                           headers=headers)
        if cfg.join != "off":
            for m, r in pairs:
                split_request(m, r)
    finally:
        await transport.close()
    if after_load is not None:
        await after_load()
    results = analyse(cfg, workload, plan, outcome, ms, tokenizer, caps, join_info, run_id)
    return results, ms


# The bench's own delays distort what it measures in proportion to it: 6 ms of send lag is noise on 13 s latencies
# and half of a 12 ms TTFT. A delay counts once its P99 exceeds this share of the median latency it lands in.
DISTORTION_SHARE = 0.10
DELAY_FLOOR_S = 0.001  # below a millisecond no latency a person reads changes
CPU_LIMIT = 0.90  # of one core: the event loop runs on one, and near it every timestamp waits
HEALTH_RULE = (f"The bench counts as a bottleneck when a delay of its own (P99 send lag, P99 event-loop lag) "
               f"exceeds {DISTORTION_SHARE:.0%} of the median TTFT it lands in (and 1 ms), when it used more than "
               f"{CPU_LIMIT:.0%} of a CPU core, or when its in-flight cap held back sends.")


def _median_latency(metrics: dict, name: str) -> float | None:
    v = (((metrics.get(name) or {}).get("percentiles") or {}).get("p50") or {}).get("value")
    return float(v) if v else None  # 0 (all zero ITL gaps) is no scale to judge against


def _fmt_s(x: float) -> str:
    """Seconds for a sentence, 3 significant figures: 0.0061 -> '6.1 ms', 13.2 -> '13.2 s'."""
    if x < 1e-3:
        return f"{x * 1e6:.3g} µs"
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def _share(x: float) -> str:
    return f"{x * 100:.2g}%" if x < 0.1 else f"{x * 100:.0f}%"


def _health(outcome: LoadOutcome, plan: LoadPlan, metrics: dict | None = None) -> tuple[dict, list[str]]:
    """The bench's own health, judged against the latencies it measured (``metrics``: the percentile table)."""
    metrics = metrics or {}
    warnings: list[str] = []
    lag = outcome.send_lag
    loop_lag = outcome.loop_lag
    cpu = outcome.cpu_seconds / outcome.wall_seconds if outcome.wall_seconds > 0 else 0.0
    h: dict[str, Any] = {
        "send_lag_s": {"p50": float(np.percentile(lag, 50)) if lag.size else None,
                       "p99": float(np.percentile(lag, 99)) if lag.size else None,
                       "max": float(lag.max()) if lag.size else None},
        "event_loop_lag_s": {"p50": float(np.percentile(loop_lag, 50)) if loop_lag.size else None,
                             "p99": float(np.percentile(loop_lag, 99)) if loop_lag.size else None,
                             "max": float(loop_lag.max()) if loop_lag.size else None},
        "cpu_util": cpu,
        "inflight_cap_hits": outcome.inflight_waits,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    # every TTFT and E2E starts at the intended send: the send lag and the loop's lag are inside them
    scale_name = "TTFT" if _median_latency(metrics, "ttft") else "E2E"
    scale = _median_latency(metrics, "ttft") or _median_latency(metrics, "e2e")
    per_token = _median_latency(metrics, "tpot") or _median_latency(metrics, "itl")
    checks: list[dict] = []
    for key, label in (("send_lag_s", "send lag"), ("event_loop_lag_s", "event-loop lag")):
        p99 = h[key]["p99"]
        if p99 is None:
            continue
        share = p99 / scale if scale else None
        bad = p99 > DELAY_FLOOR_S and (share is None or share > DISTORTION_SHARE)
        checks.append({"check": label, "value_s": p99, "against": f"median {scale_name}", "against_s": scale,
                       "share": share, "limit_share": DISTORTION_SHARE, "bottleneck": bool(bad)})
    checks.append({"check": "CPU", "value": cpu, "limit": CPU_LIMIT, "bottleneck": cpu > CPU_LIMIT})
    checks.append({"check": "in-flight cap", "value": outcome.inflight_waits, "limit": 0,
                   "bottleneck": outcome.inflight_waits > 0})
    h["checks"] = checks
    bottleneck = any(c["bottleneck"] for c in checks)
    why_lag = (f"the bench used {_share(cpu)} of a CPU core, so the delay came from its machine (other processes, "
               "the scheduler), not from its own work" if cpu <= CPU_LIMIT / 2 else
               f"the bench used {_share(cpu)} of a CPU core: run fewer streams per bench process")
    for c in checks:
        if not c["bottleneck"]:
            continue
        if c["check"] in ("send lag", "event-loop lag"):
            against = (f", {_share(c['share'])} of the {c['against']} ({_fmt_s(c['against_s'])})"
                       if c["share"] is not None else "")
            what = ("the bench sent requests late" if c["check"] == "send lag" else
                    "the bench's event loop ran late, so its timestamps are late")
            warnings.append(f"{what}: {c['check']} P99 {_fmt_s(c['value_s'])}{against}; the measured latencies "
                            f"include that delay ({why_lag})")
        elif c["check"] == "CPU":
            warnings.append(f"the bench used {_share(cpu)} of a CPU core: it may be the bottleneck; run fewer "
                            "streams per bench process")
        else:
            warnings.append(f"the in-flight cap ({plan.max_inflight}) held back {outcome.inflight_waits} sends: the "
                            "offered load was not delivered as planned")
    loop99 = h["event_loop_lag_s"]["p99"]
    if loop99 is not None and per_token and loop99 > DELAY_FLOOR_S and loop99 > DISTORTION_SHARE * per_token:
        # not a bottleneck of the run, but the gaps between tokens are small enough for the loop's lag to blur them
        h["token_timing_blurred"] = True
        warnings.append(f"the bench's event loop lagged up to {_fmt_s(loop99)} (P99), {_share(loop99 / per_token)} "
                        f"of the median time per output token ({_fmt_s(per_token)}): the ITL tail partly shows "
                        "the bench's own delay")
    h["bench_is_bottleneck"] = bottleneck
    h["rule"] = HEALTH_RULE
    h["verdict"] = _health_verdict(h, scale, scale_name)
    return h, warnings


def _health_verdict(h: dict, scale: float | None, scale_name: str) -> str:
    """The bench's health in one or two plain sentences."""
    parts = []
    for c in h["checks"]:
        if c["check"] in ("send lag", "event-loop lag"):
            rel = (f" ({_share(c['share'])} of the median {scale_name}, {_fmt_s(scale)})" if c["share"] is not None
                   else "")
            parts.append(f"{c['check']} P99 {_fmt_s(c['value_s'])}{rel}")
    parts.append(f"{_share(h['cpu_util'])} of a CPU core used")
    caps = h["inflight_cap_hits"]
    parts.append("no send held back by the in-flight cap" if not caps else f"{caps} sends held back by the cap")
    facts = "; ".join(parts)
    if h["bench_is_bottleneck"]:
        bad = ", ".join(c["check"] for c in h["checks"] if c["bottleneck"])
        return f"The bench may have distorted these latencies ({bad}): {facts}."
    return f"The bench kept up: its own delays are small next to the latencies it measured ({facts})."


def saturation_warning(summary: dict, metrics: dict, offered: float) -> str | None:
    """A warning when the server fell behind the offered rate, else None.

    The run's window ends with the last answer, one latency after the last send: completions over the whole window
    would read as "behind" whenever latencies are long next to the run (18 requests at 0.2 req/s with 13 s
    latencies). So the rate at which the server completed requests is taken over the window less one median E2E.
    """
    completed = summary["requests"]["completed"]
    window = summary.get("duration_s") or 0.0
    if not completed or not offered or not np.isfinite(offered) or window <= 0:
        return None
    e2e50 = _median_latency(metrics, "e2e") or 0.0
    serving = window - e2e50 if window - e2e50 > 0 else window
    served = completed / serving
    summary["throughput"]["completed_while_offered_per_s"] = served
    if served >= 0.9 * offered:
        return None
    return (f"the server completed {served:.3g} req/s while {offered:.3g} req/s were offered: it fell behind, so "
            "its queues grew during the run and later requests waited longer (lower the rate to find what it "
            "sustains)")


def _by_language(ms) -> dict:
    out: dict[str, dict] = {}
    for lang in sorted({m.lang for m in ms}):
        rows = [m for m in ms if m.lang == lang and m.ok]
        if not rows:
            continue
        d: dict[str, Any] = {"requests": len(rows),
                             "failed_excluded": sum(1 for m in ms if m.lang == lang and not m.ok)}
        for name in ("ttft", "e2e"):
            v = [getattr(m, name) for m in rows if getattr(m, name) is not None]
            d[f"{name}_p50_s"] = float(np.percentile(v, 50)) if v else None
            d[f"{name}_p99_s"] = float(np.percentile(v, 99)) if v else None
        pt = [m.prompt_tokens or m.prompt_tokens_local for m in rows if (m.prompt_tokens or m.prompt_tokens_local)]
        d["prompt_tokens_mean"] = float(np.mean(pt)) if pt else None
        tk = [m.stages["tokenize"] for m in rows if m.stages and "tokenize" in m.stages]
        if tk:
            d["server_tokenize_p50_s"] = float(np.percentile(tk, 50))
            d["server_tokenize_p99_s"] = float(np.percentile(tk, 99))
            d["server_tokenize_us_per_token"] = float(np.mean(tk)) / max(1.0, float(np.mean(pt))) * 1e6 if pt else None
        out[lang] = d
    return out


def analyse(cfg: BenchConfig, workload, plan: LoadPlan, outcome: LoadOutcome, ms, tokenizer, caps: dict,
            join_info: dict, run_id: str) -> dict:
    from tailguard import __version__

    agg = aggregate(ms, reps=cfg.bootstrap, seed=cfg.seed,
                    failures_at=cfg.timeout if cfg.failures_as_timeout else None)
    stages = stage_report(agg.measured)
    pairs = [(m, r) for m, r in zip(ms, outcome.results) if not m.warmup]
    terr = timing_error(pairs)
    profiles = load_profiles(list(cfg.profiles))
    # the verdicts reuse the percentile table's CIs where they judge the same sample: one figure, one CI
    slo = {p.name: evaluate(p, agg.measured, agg.window, cfg.bootstrap, cfg.seed, shared=agg.metrics)
           for p in profiles}
    classes = None
    if cfg.classes:
        from tailguard.bench.classes import analyse_classes

        cw = workload if hasattr(workload, "classes") else None
        classes = analyse_classes(cw.classes if cw is not None else cfg.classes, agg.measured, profiles, slo,
                                  agg.window, cfg.bootstrap, cfg.seed,
                                  cfg.timeout if cfg.failures_as_timeout else None,
                                  by_column=bool(cw is not None and cw.by_column), column=cfg.class_column)
    health, warnings = _health(outcome, plan, agg.metrics)
    s = agg.summary
    if s["requests"]["failed"]:
        kinds = ", ".join(f"{k} x{v}" for k, v in s["errors_by_kind"].items())
        warnings.append(f"{s['requests']['failed']} of {s['requests']['measured']} requests failed ({kinds}); "
                        + ("they are left out of the percentiles (--failures-as-timeout puts them in the tail) "
                           if not cfg.failures_as_timeout else "they enter TTFT/E2E at the request timeout ")
                        + "and count as SLO misses")
    if classes is not None:
        warnings.extend(_class_warnings(classes, cfg))
    if plan.mode == "open" and plan.offsets is not None and len(plan.offsets) > 1 and s["throughput"]["requests_per_s"]:
        offered = arrivals.achieved_rate(np.asarray(plan.offsets[: s["requests"]["sent"]]))
        s["throughput"]["offered_requests_per_s"] = offered
        behind = saturation_warning(s, agg.metrics, offered)
        if behind:
            warnings.append(behind)
    if plan.mode == "closed":
        warnings.append("closed loop: each stream waits for its previous answer, so a slow server slows the offered "
                        "load too; for tail latency under a fixed offered load use --rate")
    for note in caps.get("notes", []):
        warnings.append(note)
    tok = agg.tokens
    fo = tok["fixed_output"]
    if caps.get("fixed_output", cfg.fixed_output) and fo["share_shorter"]:
        warnings.append(f"{fo['shorter_than_max_tokens']} of {fo['requests']} answers were shorter than max_tokens: "
                        "the server does not honour ignore_eos/min_tokens, output lengths are not fixed")
    if tok["usage_missing_requests"]:
        d = tok["recount_vs_usage_drift"]
        warnings.append(f"{tok['usage_missing_requests']} answers had no usage: their token counts are local recounts "
                        f"({getattr(tokenizer, 'name', '?')} tokenizer)" +
                        (f", which drift {d['p50_rel'] * 100:+.1f}% from usage where both exist" if d else ""))
    if getattr(tokenizer, "name", "") == "approx":
        warnings.append("no model tokenizer was available: local token counts are approximate "
                        "(run `tailguard model pull` for the SmolLM2 tokenizer)")
    if tok["chunks"]["multi_token"]:
        c = tok["chunks"]
        warnings.append(f"{c['multi_token']} chunks ({c['multi_token_share'] * 100:.1f}%) carried several tokens "
                        f"(up to {c['max_tokens_per_chunk']}): each adds k-1 zero gaps to ITL")
    if stages["mode"] in ("client", "llama.cpp"):
        warnings.append("stage split: " + "; ".join(stages["cannot_split"]) + " cannot be split")
    # tokenization cost per language, on up to 40 prompts of each language of this run
    texts: dict[str, list[str]] = {}
    for m, r in zip(ms, outcome.results):
        spec = r.spec
        if spec is not None and len(texts.setdefault(m.lang, [])) < 40:
            texts[m.lang].append(spec.text())
    tcost = tokenization_cost(tokenizer, texts)
    load = plan.describe()
    if plan.mode == "open":
        load.update(arrival=cfg.arrival if not isinstance(_base(workload), TraceWorkload) else "trace",
                    rate=cfg.rate, burstiness=cfg.burstiness if cfg.arrival == "gamma" else None)
    results = {
        "schema": SCHEMA,
        "tool": {"name": "tailguard bench", "version": __version__, "http_client": cfg.http_client},
        "run": {
            "id": run_id, "label": cfg.label,
            "started_at": datetime.fromtimestamp(outcome.started_unix, UTC).isoformat(),
            "target": {"url": redact_url(cfg.url), "model": cfg.model, "endpoint": cfg.path(), "stream": cfg.stream},
            "load": load, "workload": workload.describe(), "seed": cfg.seed,
            "options": {k: (redact_url(v) if k == "url" else v) for k, v in asdict(cfg).items()
                        if k not in ("api_key", "headers", "classes")},
            "capabilities": caps, "join": join_info, "command": command_line(sys.argv),
        },
        "summary": s,
        "metrics": agg.metrics,
        "tokens": tok,
        "stages": stages,
        "timing_error": terr,
        "slo": slo,
        "advisories": golden_rules(agg.metrics),
        "slowest": slowest(agg.measured),
        "by_language": _by_language(agg.measured),
        "tokenization_cost": tcost,
        "bench_health": health,
        "warnings": warnings,
        "samples": samples(agg.measured, cfg.seed, classes=classes is not None),
    }
    if classes is not None:
        results["classes"] = classes
    # no secret in any output, even one a server echoed back in an error message
    hidden = run_secrets(cfg)
    if hidden:
        results = scrub(results, hidden)
        for m in ms:
            m.error = scrub(m.error, hidden)
    if isinstance(_base(workload), TraceWorkload):
        results["run"]["workload"]["attribution"] = ("Azure LLM inference trace 2023, CC-BY 4.0, Patel et al., "
                                                     "Splitwise (ISCA 2024)")
    return results


def _class_warnings(classes: dict, cfg: BenchConfig) -> list[str]:
    """Classes that got no request, and shares that the trace's column overrode."""
    out = []
    for name, d in classes["by_class"].items():
        if not d["requests"]["measured"]:
            out.append(f"class {name} got no measured request: its figures and verdicts are empty (raise its share "
                       "or the number of requests)")
    if classes["assignment"] == "column" and any(c.share is not None for c in cfg.classes):
        out.append(f"the trace's {cfg.class_column!r} column names each request's class: the classes' shares are "
                   "not used")
    return out


def write_outputs(results: dict, ms, out_dir: str | Path) -> dict[str, Path]:
    from tailguard.bench.report import write_report
    from tailguard.bench.results import write_csv, write_json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "csv": out / "requests.csv", "html": out / "report.html"}
    write_json(paths["json"], results)
    write_csv(paths["csv"], ms)
    write_report(results, paths["html"])
    return paths


def run_sync(cfg: BenchConfig, **kw) -> tuple[dict, list]:
    """``execute`` on a fresh event loop (uvloop when present); writes the outputs when ``cfg.output_dir`` is set."""
    try:
        import uvloop

        run = uvloop.run
    except ImportError:  # pragma: no cover
        run = asyncio.run
    results, ms = run(execute(cfg, **kw))
    if cfg.output_dir:
        write_outputs(results, ms, cfg.output_dir)
    return results, ms


def default_output_dir() -> Path:
    return Path("runs") / ("bench-" + time.strftime("%Y%m%d-%H%M%S"))
