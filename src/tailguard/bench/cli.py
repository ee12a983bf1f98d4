"""``tailguard bench ...``: run a load test, compare two runs (a CI gate), sweep for capacity, or start a fake server.

Wired into the main CLI with ``add_bench_parser(sub)`` and ``run_bench(args)``. Every bad input ends in one line on
stderr and exit code 2 (never a traceback); a failed ``--gate`` or ``--fail-on-slo`` exits 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tailguard.bench.redact import redact_url, scrub, secret_values

__all__ = ["add_bench_parser", "run_bench"]

EXIT_USAGE = 2
EXIT_GATE = 1


class UsageError(ValueError):
    """A bad flag value or input file: reported in one line, exit code 2."""


# --- parser ---------------------------------------------------------------------------------------------------

def _add_run_args(p: argparse.ArgumentParser, target: bool = True) -> None:
    """The flags of one load run; ``target=False`` leaves out --url (``bench ab`` takes its targets as --arm)."""
    t = p.add_argument_group("target")
    if target:
        t.add_argument("--url",
                       help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000 (required for a run)")
    t.add_argument("--model", help="model name to request (default: the first one /v1/models lists)")
    t.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                   help="/v1/chat/completions (default) or /v1/completions")
    t.add_argument("--no-stream", dest="stream", action="store_false", help="ask for whole answers, not SSE")
    t.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY or $TAILGUARD_API_KEY)")
    t.add_argument("--header", action="append", default=[], metavar="NAME:VALUE", help="extra header (repeatable)")
    t.add_argument("--http-client", choices=["aiohttp", "httpx"], default="aiohttp",
                   help="HTTP client library that sends the requests")
    t.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    t.add_argument("--failures-as-timeout", action="store_true",
                   help="put failed, cut-off and refused requests into the TTFT/E2E percentiles at --timeout "
                        "(default: percentiles of completed requests, with the failures counted beside them)")

    ld = p.add_argument_group("load")
    mode = ld.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int,
                      help="closed loop: N streams, each sends when its last answer ends (default: 1 stream, unless "
                           "--rate or a trace sets the load)")
    mode.add_argument("--rate", type=float,
                      help="open loop: R requests/s on average, latency counted from the intended send (default: "
                           "unset, a closed loop)")
    ld.add_argument("--arrival", choices=["poisson", "gamma", "constant"], default="poisson",
                    help="open loop: how send times are spread around --rate")
    ld.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape: 1 = Poisson, < 1 burstier, > 1 more regular")
    size = ld.add_mutually_exclusive_group()
    size.add_argument("--num-requests", type=int, help="measured requests (default 100; a trace: all of it)")
    size.add_argument("--duration", type=float, help="seconds of load instead of a request count (default: unset)")
    ld.add_argument("--warmup-requests", type=int, default=0, help="first N requests sent but not measured")
    ld.add_argument("--warmup-seconds", type=float, default=0.0, help="requests sent in the first S s not measured")
    ld.add_argument("--max-inflight", type=int, default=10_000, help="open loop: cap on requests in flight")

    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=["synthetic", "long", "jsonl", "trace"], default=None,
                   help="synthetic (default), long (long-context document + question), jsonl, trace")
    w.add_argument("--input-tokens", type=int, default=256, help="prompt length in tokens (synthetic, long)")
    w.add_argument("--output-tokens", type=int, default=128, help="max_tokens (fixed where the server allows)")
    w.add_argument("--input-spread", type=float, default=0.0, help="prompt length uniform +- this fraction")
    w.add_argument("--output-spread", type=float, default=0.0, help="output length uniform +- this fraction")
    w.add_argument("--langs", default="en", help="comma list of en, zh, mixed (requests cycle through them)")
    w.add_argument("--jsonl", metavar="FILE",
                   help="JSONL workload: prompt or messages, optional max_tokens, business_type, user (default: none)")
    w.add_argument("--trace", help="trace to replay: conv, code (Azure 2023, shipped; also azure-conv, azure-code) or "
                                   "a CSV path (default: none; --workload trace alone: conv)")
    w.add_argument("--trace-speedup", "--time-scale", dest="trace_speedup", type=float, default=1.0,
                   help="replay the trace this many times faster (2: twice its arrival rate, every gap halved)")
    w.add_argument("--length-scale", type=float, default=1.0, help="multiply the trace's token lengths")
    w.add_argument("--trace-start", type=float, default=0.0, help="start this many trace seconds in")
    w.add_argument("--trace-duration", type=float, help="replay only this many trace seconds (default: all of it)")
    w.add_argument("--window", metavar="busiest:S|START:S|all",
                   help="the part of the trace to replay, in trace seconds: busiest:600 (the 600 s with the most "
                        "arrivals, its peak), 120:600 (600 s from 120 s in) or all (default: all of it, or "
                        "--trace-start/--trace-duration)")
    w.add_argument("--max-input-tokens", type=int, help="clip trace prompt lengths (default: no clipping)")
    w.add_argument("--max-output-tokens", type=int, help="clip trace output lengths (default: no clipping)")
    w.add_argument("--business-type",
                   help="X-Business-Type of every synthetic request, e.g. vip, mobile (default: no header)")
    w.add_argument("--no-fixed-output", dest="fixed_output", action="store_false",
                   help="do not send ignore_eos/min_tokens (answers end where the model stops)")
    w.add_argument("--continuous-usage", action="store_true",
                   help="ask for usage on every chunk (vLLM's continuous_usage_stats): exact tokens per chunk")
    w.add_argument("--temperature", type=float, default=0.0, help="sampling temperature sent with each request (0-2)")
    w.add_argument("--tokenizer", default="auto",
                   help="local token counter: auto (SmolLM2 when pulled, else approx), approx, or a .gguf path")

    c = p.add_argument_group("traffic classes")
    c.add_argument("--class", dest="traffic_class", action="append", default=[], metavar="SPEC",
                   help="a traffic class (repeatable), e.g. name=vip,share=0.1,key=sk-vip,profile=strict,"
                        "prompt-tokens=128,output-tokens=64; fields: name, share (0.1 or 10%%; one class may leave "
                        "it out and take the rest), key (sent as Authorization: Bearer), key-env (the key from an "
                        "environment variable), profile (SLO profiles joined by +: built-in names, names from "
                        "--profiles-file, YAML files; default: --profiles), prompt-tokens, output-tokens, "
                        "input-spread, output-spread, langs (joined by +), business-type, header (NAME:VALUE, "
                        "repeatable). Results, report and compare --gate then cover each class and the whole")
    c.add_argument("--classes", dest="classes_file", metavar="FILE",
                   help="the traffic classes from a YAML or JSON file: 'classes:' with a list of the fields of "
                        "--class, and optionally 'column:' (see --class-column)")
    c.add_argument("--class-column", metavar="NAME",
                   help="take each request's class from this column of the replayed trace instead of the shares "
                        "(default: a column named 'class' when the trace has one and classes are given)")

    a = p.add_argument_group("analysis and output")
    a.add_argument("--profiles", default="baseline,advanced,strict",
                   help="comma list of SLO profiles to judge: built-in names or YAML files")
    a.add_argument("--profiles-file", action="append", default=[], metavar="YAML",
                   help="YAML file of custom SLO profiles (repeatable; added to --profiles)")
    a.add_argument("--bootstrap", type=int, default=1000, help="bootstrap replicates for confidence intervals")
    a.add_argument("--join", choices=["auto", "fetch", "off"], default="auto",
                   help="stage join with the server's timeline: auto, fetch (GET /v1/requests/{id}), off")
    a.add_argument("--join-max", type=int, default=2000, help="most records to fetch for the join")
    a.add_argument("--no-probe", dest="probe", action="store_false",
                   help="skip the unmeasured probe request that finds which options the server accepts")
    a.add_argument("--output-dir", help="where results.json, requests.csv and report.html go "
                                        "(default runs/bench-YYYYmmdd-HHMMSS)" if target else
                   "where results.json, report.html and each arm's runs go (default runs/ab-YYYYmmdd-HHMMSS)")
    a.add_argument("--label", help="a name for this run, shown by compare (default: none)")
    a.add_argument("--seed", type=int, default=0, help="seeds arrivals, prompts and the bootstrap")
    a.add_argument("--fail-on-slo", action="store_true",
                   help="exit 1 when any judged SLO profile fails (of the whole run or of a traffic class)")
    a.add_argument("--quiet", "-q", action="store_true", help="no progress bar and no summary table")


def _add_gate_rules(p: argparse.ArgumentParser | Any) -> None:
    p.add_argument("--gate-percentiles", default="50", help="comma list of gated percentiles (default 50)")
    p.add_argument("--gate-metrics", default="ttft,itl,tpot,e2e", help="comma list of gated metrics")
    p.add_argument("--min-rel", type=float, default=0.05, help="smallest relative regression that fails the gate")
    p.add_argument("--min-abs-ms", type=float, default=1.0, help="smallest absolute regression (ms) that fails")
    p.add_argument("--no-slo-gate", dest="slo_gate", action="store_false",
                   help="do not fail the gate on B's SLO verdicts")
    p.add_argument("--gate-classes", metavar="NAMES",
                   help="comma list of the traffic classes whose regressions and SLO verdicts fail the gate "
                        "(default: every class both runs have; 'none': the whole run only)")


def _add_ab_args(ab: argparse.ArgumentParser) -> None:
    g = ab.add_argument_group("arms")  # first: what an A/B run is about
    g.add_argument("--arm", action="append", default=[], metavar="NAME=URL|NAME=cmd:COMMAND",
                   help="an arm (repeatable, at least two; the first is the baseline): NAME=URL of a running "
                        "OpenAI-compatible server, used as is, or NAME=cmd:COMMAND that starts one, with {port} "
                        "where a free 127.0.0.1 port goes: started before each of its repeats, waited for until "
                        "healthy, stopped after (SIGTERM, then SIGKILL after --stop-grace); run without a shell")
    g.add_argument("--replicas", action="append", default=[], metavar="NAME=N",
                   help="the replicas an arm runs on, for its cost in replica-seconds (repeatable; default 1 per "
                        "arm; a tailguard gateway's own figure is read from its /metrics when it exports one)")
    g.add_argument("--arm-header", action="append", default=[], metavar="NAME=HEADER:VALUE",
                   help="an extra header of one arm's requests (repeatable), on top of --header")
    g.add_argument("--arm-key", action="append", default=[], metavar="NAME=KEY",
                   help="one arm's API key, instead of --api-key (repeatable; a traffic class's key still replaces "
                        "it for the class's requests)")
    g.add_argument("--arm-key-env", action="append", default=[], metavar="NAME=VAR",
                   help="one arm's API key from an environment variable (repeatable)")
    g.add_argument("--arm-model", action="append", default=[], metavar="NAME=MODEL",
                   help="one arm's model name, instead of --model (repeatable; default: --model, else the first "
                        "model the arm's /v1/models lists)")
    g.add_argument("--admin-key-env", default="TAILGUARD_ADMIN_KEY", metavar="VAR",
                   help="environment variable with a gateway's admin key, to read its replica-seconds from "
                        "/admin/upstreams when /metrics has none")
    g.add_argument("--health-timeout", type=float, default=120.0,
                   help="seconds a command arm has to become healthy (a URL arm, already running: at most 5)")
    g.add_argument("--health-path", metavar="PATH",
                   help="the path whose 200 says a command arm is up (default: /ready, then /health, then "
                        "/v1/models)")
    g.add_argument("--stop-grace", type=float, default=10.0,
                   help="seconds between SIGTERM and SIGKILL when a command arm is stopped")
    _add_run_args(ab, target=False)
    r = ab.add_argument_group("repeats and sweep")
    r.add_argument("--repeats", type=int, default=2, help="runs of the schedule per arm")
    r.add_argument("--order", choices=["abba", "abab"], default="abba",
                   help="abba: each round reverses the arms (A B B A A B ...), so slow drift of the machine falls on "
                        "every arm alike; abab: the same order every round")
    r.add_argument("--pause", type=float, default=0.0, help="seconds to wait between runs")
    r.add_argument("--sweep-scales", metavar="LIST",
                   help="comma list of time scales, e.g. 1,2,4: each arm also runs the schedule at each, and the "
                        "report gives the highest scale (and its offered rate) at which the arm meets the SLO "
                        "(default: not swept)")
    r.add_argument("--sweep-repeats", type=int, default=1, help="runs per arm at each swept scale")
    r.add_argument("--sweep-profile", metavar="NAME",
                   help="the SLO profile a swept scale must pass (default: every judged profile, and every traffic "
                        "class's)")
    gt = ab.add_argument_group("gate")
    gt.add_argument("--gate", action="store_true",
                    help="exit 1 when an arm regressed against the first (the baseline) by the rules of "
                         "'bench compare --gate', or fails an SLO profile")
    _add_gate_rules(gt)


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    bench = subparsers.add_parser(
        "bench", help="load-test an OpenAI-compatible server: latency percentiles, stage split, SLO verdicts",
        description="Run a load test against any OpenAI-compatible server (tailguard bench --url URL ...): latency "
                    "percentiles with confidence intervals, the stage split joined from the server's timeline, SLO "
                    "verdicts; results.json, requests.csv and report.html in --output-dir. Or: compare, sweep, ab, "
                    "fake-server (tailguard bench COMMAND --help).",
        allow_abbrev=False)  # abbreviations would make the sweep's --profile clash with --profiles
    _add_run_args(bench)
    sub = bench.add_subparsers(dest="bench_command", required=False, metavar="{compare,sweep,ab,fake-server}")

    cmp = sub.add_parser("compare", help="B vs A: deltas with confidence intervals; --gate for CI",
                         description="Compare two bench runs, B against the baseline A: per-metric percentile deltas "
                                     "with bootstrap confidence intervals. With --gate: exit 1 on a significant "
                                     "regression of a gated percentile or a failed SLO profile of B.")
    cmp.add_argument("a", help="baseline results.json (or a run directory)")
    cmp.add_argument("b", help="candidate results.json (or a run directory)")
    cmp.add_argument("--html", metavar="FILE", help="also write an HTML comparison here (default: none)")
    cmp.add_argument("--json", dest="json_out", metavar="FILE",
                     help="also write the comparison as JSON here (default: none)")
    cmp.add_argument("--gate", action="store_true",
                     help="exit 1 when a gated percentile regressed significantly or B fails an SLO profile")
    _add_gate_rules(cmp)
    cmp.add_argument("--bootstrap", type=int, default=1000, help="bootstrap replicates for confidence intervals")
    cmp.add_argument("--seed", type=int, default=0, help="seeds the bootstrap")

    sw = sub.add_parser("sweep", help="the highest offered rate at which an SLO profile still passes",
                        allow_abbrev=False)
    _add_run_args(sw)
    sw.add_argument("--profile", default="baseline", help="the profile to meet (built-in name or YAML file)")
    sw.add_argument("--start-rate", type=float, default=1.0, help="first offered rate tried (req/s)")
    sw.add_argument("--max-rate", type=float, default=1000.0, help="highest offered rate tried (req/s)")
    sw.add_argument("--factor", type=float, default=2.0, help="growth factor between steps before bisecting")
    sw.add_argument("--refine", type=int, default=3, help="bisection steps between the last pass and first fail")
    sw.add_argument("--max-steps", type=int, default=20, help="most load runs in all")

    ab = sub.add_parser("ab", help="A/B arms: one replayed schedule against two or more servers, in alternating "
                                   "repeats, in one report",
                        description="Run the same schedule (a trace, time-scaled, or seeded arrivals) against two or "
                                    "more arms, each a server's URL or a command that starts one, in alternating "
                                    "repeats (A B B A ...), and write one report: per-arm percentiles with "
                                    "confidence intervals pooled over the repeats and their spread, goodput, SLO "
                                    "verdicts, the highest passing rate (--sweep-scales), where the time went, cost "
                                    "in replica-seconds, and each figure's ratio to the first arm.",
                        allow_abbrev=False)
    _add_ab_args(ab)

    fk = sub.add_parser("fake-server", help="a scripted OpenAI-compatible server on 127.0.0.1 (for trying the bench)")
    fk.add_argument("--port", type=int, default=8011, help="port (0: any free one)")
    fk.add_argument("--ttft", type=float, default=0.02, help="seconds from request to first token")
    fk.add_argument("--itl", type=float, default=0.005, help="seconds between chunks")
    fk.add_argument("--jitter", type=float, default=0.0, help="each wait times 1 + U(-jitter, +jitter)")
    fk.add_argument("--ttft-per-prompt-token", type=float, default=0.0,
                    help="seconds added to the first token's wait per prompt token")
    fk.add_argument("--multi-token-every", type=int, default=0, help="every k-th chunk carries several tokens")
    fk.add_argument("--multi-token-size", type=int, default=2, help="tokens in such a chunk")
    fk.add_argument("--eos-after", type=int, help="stop after N tokens unless ignore_eos (default: at max_tokens)")
    fk.add_argument("--error-every", type=int, default=0, help="every k-th request fails (HTTP 500)")
    fk.add_argument("--key-delay", action="append", default=[], metavar="KEY=SECONDS",
                    help="requests with this bearer key get SECONDS more TTFT (repeatable: one per traffic class)")
    fk.add_argument("--key-itl", action="append", default=[], metavar="KEY=SECONDS",
                    help="requests with this bearer key get this gap between chunks instead of --itl (repeatable)")
    fk.add_argument("--received-log", metavar="FILE",
                    help="append a JSON line per request received (its ID, a digest of its prompt, max_tokens, key) "
                         "to FILE (default: none)")
    fk.add_argument("--replicas", type=int, default=0,
                    help="act as a tailguard gateway of N replicas: export tailguard_gateway_replica_seconds_total "
                         "(N x seconds alive) on /metrics (0: no /metrics)")
    fk.add_argument("--no-timeline", action="store_true", help="no tailguard stage object or /v1/requests/{id}")
    fk.add_argument("--reject-fixed-length", action="store_true", help="answer 400 to ignore_eos/min_tokens")
    fk.add_argument("--spin", type=float, default=0.001,
                    help="last seconds of each wait spent polling (sharper timing, more CPU)")
    fk.add_argument("--seed", type=int, default=0, help="seeds the jitter")
    fk.add_argument("--max-lifetime", type=float, default=3600.0, help="exit by itself after this many seconds")
    return bench


# --- validation -----------------------------------------------------------------------------------------------

# The lowest --rate taken: below it a run waits hours for its first requests.
MIN_RATE = 0.001


def _positive(name: str, v: float | None, allow_zero: bool = False) -> None:
    if v is not None and math.isnan(v):  # NaN passes every comparison below: a run with it measures nonsense
        raise UsageError(f"{name} must be a number, got nan")
    if v is not None and math.isinf(v):
        hint = " (to send every request at once: --concurrency N --num-requests N)" if name == "--rate" else ""
        raise UsageError(f"{name} must be finite, got {v:g}{hint}")
    if v is not None and (v < 0 or (v == 0 and not allow_zero)):
        raise UsageError(f"{name} must be {'non-negative' if allow_zero else 'positive'}, got {v:g}")


def _headers(items: list[str]) -> dict[str, str]:
    out = {}
    for h in items:
        k, sep, v = h.partition(":")
        if not sep or not k.strip():
            raise UsageError(f"--header wants NAME:VALUE, got {h!r}")
        out[k.strip()] = v.strip()
    return out


def _check_url(url: str | None) -> str:
    if not url:
        raise UsageError("--url is required (the base URL of an OpenAI-compatible server, e.g. "
                         "http://127.0.0.1:8000)")
    u = urlparse(url)
    if u.scheme not in ("http", "https") or not u.netloc:
        raise UsageError(f"--url must be an http(s) URL such as http://127.0.0.1:8000, got {redact_url(url)!r}")
    # a URL given with the API path (as people paste it) is cut back to the base
    base = url.rstrip("/")
    for suffix in ("/v1/chat/completions", "/v1/completions", "/v1"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    return base


def _discover_model(url: str, headers: dict[str, str], timeout: float = 10.0) -> str:
    """The first model that ``GET /v1/models`` lists."""
    import httpx

    try:
        r = httpx.get(url + "/v1/models", headers=headers, timeout=timeout, trust_env=False)
        data = r.json().get("data") or []
        if r.status_code == 200 and data and data[0].get("id"):
            return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        raise UsageError(f"--model not given and {redact_url(url)}/v1/models could not be read "
                         f"({scrub(str(exc), secret_values(None, headers, url))}); pass --model") from None
    raise UsageError(f"--model not given and {redact_url(url)}/v1/models lists no model; pass --model")


def config_from_args(args: argparse.Namespace, target: bool = True) -> Any:
    """A validated BenchConfig from the parsed flags (raises UsageError on any bad value). ``target=False``
    (``bench ab``): no --url, and the model is left to each arm (empty unless --model)."""
    from tailguard.bench.profiles import load_profiles
    from tailguard.bench.runner import BenchConfig
    from tailguard.bench.workloads import BUILTIN_TRACES, LANGS

    url = _check_url(args.url) if target else ""
    headers = _headers(args.header)
    for name in ("concurrency", "num_requests", "input_tokens", "output_tokens", "max_inflight", "join_max",
                 "max_input_tokens", "max_output_tokens"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {v}")
    for name in ("rate", "duration", "burstiness", "trace_speedup", "length_scale", "timeout", "trace_duration"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    for name in ("warmup_requests", "warmup_seconds", "trace_start", "input_spread", "output_spread", "bootstrap"):
        _positive("--" + name.replace("_", "-"), getattr(args, name), allow_zero=True)
    if args.rate is not None and args.rate < MIN_RATE:
        raise UsageError(f"--rate must be at least {MIN_RATE:g} requests/s (one every {1 / MIN_RATE:g} s), got "
                         f"{args.rate:g}")
    if math.isnan(args.temperature):
        raise UsageError("--temperature must be a number, got nan")
    if not 0 <= args.temperature <= 2:
        raise UsageError(f"--temperature must be from 0 to 2 (what OpenAI servers accept), got {args.temperature:g}")
    if args.input_spread >= 1 or args.output_spread >= 1:
        raise UsageError("--input-spread and --output-spread are fractions below 1")
    langs = tuple(x.strip() for x in args.langs.split(",") if x.strip())
    bad = [x for x in langs if x not in LANGS]
    if not langs or bad:
        raise UsageError(f"--langs takes a comma list of {', '.join(LANGS)}; got {args.langs!r}")
    workload = args.workload or ("jsonl" if args.jsonl else "trace" if args.trace else "synthetic")
    if workload == "jsonl":
        if not args.jsonl:
            raise UsageError("--workload jsonl needs --jsonl PATH")
        if not Path(args.jsonl).is_file():
            raise UsageError(f"--jsonl: no such file: {args.jsonl}")
    elif args.jsonl:
        raise UsageError(f"--jsonl goes with --workload jsonl, not --workload {workload}")
    if workload == "trace":
        trace = args.trace or "conv"
        if trace not in BUILTIN_TRACES and not Path(trace).is_file():
            raise UsageError(f"--trace: {trace!r} is neither a built-in trace ({', '.join(BUILTIN_TRACES)}) "
                             "nor a CSV file")
        if args.concurrency:
            raise UsageError("a trace replays its own arrival times: use --trace-speedup or --rate, not "
                             "--concurrency")
    elif args.trace:
        raise UsageError(f"--trace goes with --workload trace, not --workload {workload}")
    else:
        trace = None
    trace_start, trace_duration = _window(args, trace)
    profiles = [x.strip() for x in args.profiles.split(",") if x.strip()] + list(args.profiles_file)
    for f in args.profiles_file:
        if not Path(f).is_file():
            raise UsageError(f"--profiles-file: no such file: {f}")
    try:
        run_profiles = load_profiles(profiles)  # validate now, not after the load
    except Exception as exc:  # YAML syntax errors and schema errors alike
        raise UsageError(f"SLO profiles: {exc}") from None
    classes, class_column = _classes(args, run_profiles, workload, trace)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("TAILGUARD_API_KEY")
    model = args.model
    if not model and target:
        # without a key of the run's own, the first class's key may open /v1/models
        key = api_key or next((k for c in classes if (k := c.api_key())), None)
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        model = _discover_model(url, {**headers, **auth})
    return BenchConfig(
        url=url, model=model or "", endpoint=args.endpoint, stream=args.stream, api_key=api_key, headers=headers,
        concurrency=args.concurrency, rate=args.rate, arrival=args.arrival, burstiness=args.burstiness,
        num_requests=args.num_requests, duration=args.duration, warmup_requests=args.warmup_requests,
        warmup_seconds=args.warmup_seconds, max_inflight=args.max_inflight, timeout=args.timeout,
        workload=workload, input_tokens=args.input_tokens, output_tokens=args.output_tokens,
        input_spread=args.input_spread, output_spread=args.output_spread, langs=langs, jsonl=args.jsonl,
        trace=trace, trace_speedup=args.trace_speedup, length_scale=args.length_scale, trace_start=trace_start,
        trace_duration=trace_duration, trace_window=args.window, max_input_tokens=args.max_input_tokens,
        max_output_tokens=args.max_output_tokens, business_type=args.business_type, fixed_output=args.fixed_output,
        continuous_usage=args.continuous_usage, temperature=args.temperature, profiles=tuple(profiles),
        seed=args.seed, bootstrap=args.bootstrap, http_client=args.http_client, join=args.join,
        join_max=args.join_max, tokenizer=args.tokenizer, probe=args.probe, output_dir=args.output_dir,
        progress=not args.quiet, label=args.label, failures_as_timeout=args.failures_as_timeout,
        classes=classes, class_column=class_column,
    )


def _window(args: argparse.Namespace, trace: str | None) -> tuple[float, float | None]:
    """(start, duration) in trace seconds, from --window or from --trace-start/--trace-duration."""
    from tailguard.bench.workloads import busiest_window, parse_window

    if not args.window:
        return args.trace_start, args.trace_duration
    if trace is None:
        raise UsageError("--window picks a part of a replayed trace: use it with --trace")
    if args.trace_start or args.trace_duration is not None:
        raise UsageError("give the part of the trace with --window or with --trace-start/--trace-duration, not both")
    try:
        kind, start, length = parse_window(args.window)
        if kind == "busiest":
            assert length is not None
            start, _ = busiest_window(trace, length)
    except (ValueError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from None
    return (start or 0.0), length


def _classes(args: argparse.Namespace, run_profiles: list, workload: str, trace: str | None) -> tuple[tuple, str | None]:
    """The traffic classes of --class or --classes, checked (shares, keys, profiles, trace column) before any load."""
    from tailguard.bench.classes import classes_from_file, classes_from_specs, resolve_profiles, settle_shares
    from tailguard.bench.workloads import trace_columns

    specs, file = args.traffic_class, args.classes_file
    if not specs and not file:
        if args.class_column:
            raise UsageError("--class-column names the column that holds each request's class: give the classes "
                             "too (--class or --classes)")
        return (), None
    if specs and file:
        raise UsageError("give the traffic classes with --class flags or with --classes FILE, not both")
    if file and not Path(file).is_file():
        raise UsageError(f"--classes: no such file: {file}")
    try:
        classes, column = classes_from_file(file) if file else (classes_from_specs(specs), None)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    column = args.class_column or column
    if column and workload != "trace":
        raise UsageError(f"--class-column reads a column of a replayed trace: use it with --trace, not "
                         f"--workload {workload}")
    if workload == "trace" and trace is not None:
        cols = trace_columns(trace)
        lower = {c.lower() for c in cols}
        if column and column.lower() not in lower:
            raise UsageError(f"the trace {trace} has no column {column!r} to take the class from (columns: "
                             f"{', '.join(cols)})")
        if not column and "class" in lower:
            column = "class"
    for c in classes:
        if c.key_env and not os.environ.get(c.key_env):
            raise UsageError(f"class {c.name!r}: the environment variable {c.key_env} (key-env) is not set")
    base_dir = Path(file).parent if file else None
    known = {p.name for p in run_profiles}
    fixed = []
    for c in classes:
        names = []
        for n in c.profile:  # a YAML path in a classes file is relative to that file
            if base_dir is not None and n not in known and not Path(n).is_file() and (base_dir / n).is_file():
                n = str(base_dir / n)
            names.append(n)
        try:
            resolve_profiles(names, run_profiles)
        except Exception as exc:  # unknown names, YAML errors, schema errors
            raise UsageError(f"class {c.name!r}: SLO profile: {exc}") from None
        fixed.append(c.model_copy(update={"profile": tuple(names)}))
    try:
        fixed = settle_shares(fixed, by_column=bool(column))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return tuple(fixed), column


# --- commands -------------------------------------------------------------------------------------------------

def run_bench(args: argparse.Namespace) -> int:
    try:
        cmd = getattr(args, "bench_command", None)
        if cmd == "compare":
            return _cmd_compare(args)
        if cmd == "fake-server":
            return _cmd_fake_server(args)
        if cmd == "sweep":
            return _cmd_run(args, sweep=True)
        if cmd == "ab":
            return _cmd_ab(args)
        return _cmd_run(args, sweep=False)
    except UsageError as exc:
        print(f"tailguard bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("tailguard bench: interrupted", file=sys.stderr)
        return 130


def _cmd_run(args: argparse.Namespace, sweep: bool) -> int:
    from tailguard.bench.runner import default_output_dir, execute, write_outputs

    cfg = config_from_args(args)
    console = _console()
    try:
        if sweep:
            _positive("--start-rate", args.start_rate)
            _positive("--max-rate", args.max_rate)
            if not args.factor > 1:  # NaN too
                raise UsageError("--factor must be above 1")
            if args.rate or args.concurrency:
                raise UsageError("the sweep chooses the rate itself: drop --rate/--concurrency")
            if cfg.num_requests is None and cfg.duration is None:
                cfg.num_requests = 200  # per step
            from tailguard.bench.profiles import load_profiles
            from tailguard.bench.sweep import sweep as run_sweep

            try:
                prof = load_profiles([args.profile])[0].name
            except Exception as exc:
                raise UsageError(f"--profile: {exc}") from None

            def on_step(s: dict) -> None:
                if not args.quiet:
                    verdict = "[green]pass[/]" if s["pass"] else "[red]fail[/]"
                    console.print(f"  rate {s['rate']:8.2f} req/s: {verdict}  E2E P99 {_ms(s['e2e_p99_s'])} ms  "
                                  f"TTFT P99 {_ms(s['ttft_p99_s'])} ms  achieved {s['achieved_rps'] or 0:.2f} req/s  "
                                  f"failed {s['failed']}")

            if not args.quiet:
                console.print(f"sweep against the {prof} profile, {cfg.num_requests or cfg.duration} "
                              f"{'requests' if cfg.num_requests else 's'} per step")
            results, ms = _run_async(run_sweep(cfg, profile=args.profile, start=args.start_rate, max_rate=args.max_rate,
                                               factor=args.factor, refine=args.refine, max_steps=args.max_steps,
                                               on_step=on_step))
        else:
            results, ms = _run_async(execute(cfg))
    except (ValueError, FileNotFoundError) as exc:  # bad workload files, empty trace windows, ...
        raise UsageError(str(exc)) from None
    except ConnectionError as exc:
        raise UsageError(str(exc)) from None
    out = Path(args.output_dir) if args.output_dir else default_output_dir()
    try:
        paths = write_outputs(results, ms, out)
    except OSError as exc:
        raise UsageError(f"cannot write to {out}: {exc}") from None
    if not args.quiet:
        print_summary(results, console)
        for kind in ("json", "csv", "html"):
            console.print(f"{kind:>4}: {paths[kind]}")
    else:
        print(paths["html"])
    if args.fail_on_slo and (any(v.get("evaluated") and not v.get("pass") for v in results["slo"].values())
                             or any(d.get("pass") is False for d in
                                    ((results.get("classes") or {}).get("by_class") or {}).values())):
        return EXIT_GATE
    return 0


def _run_async(coro):
    import asyncio

    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)


def _resolve_results(p: str) -> str:
    path = Path(p)
    if path.is_dir():
        path = path / "results.json"
    if not path.is_file():
        raise UsageError(f"no such results file: {p}")
    return str(path)


def _gate_rules(args: argparse.Namespace) -> Any:
    from tailguard.bench.compare import METRICS, GateRules

    try:
        pcts = tuple(float(x) for x in args.gate_percentiles.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"--gate-percentiles takes numbers such as 50,99; got {args.gate_percentiles!r}") from None
    metrics = tuple(x.strip().lower() for x in args.gate_metrics.split(",") if x.strip())
    if not pcts or any(not 0 < q < 100 for q in pcts):
        raise UsageError("--gate-percentiles must lie in (0, 100)")
    if not metrics or any(m not in METRICS for m in metrics):
        raise UsageError(f"--gate-metrics takes a comma list of {', '.join(METRICS)}")
    gate_classes = None
    if args.gate_classes is not None:
        names = tuple(x.strip() for x in args.gate_classes.split(",") if x.strip())
        gate_classes = () if names == ("none",) else names
        if not names:
            raise UsageError("--gate-classes takes a comma list of class names, or none")
    # NaN compares False with everything, so a NaN minimum effect would pass every regression: reject it
    _positive("--min-rel", args.min_rel, allow_zero=True)
    _positive("--min-abs-ms", args.min_abs_ms, allow_zero=True)
    return GateRules(percentiles=pcts, metrics=metrics, min_rel=args.min_rel, min_abs=args.min_abs_ms / 1e3,
                     slo=args.slo_gate, classes=gate_classes)


# Fewer bootstrap replicates give no confidence interval, so no delta is ever significant and a gate always passes.
MIN_GATE_BOOTSTRAP = 10


def _check_bootstrap(args: argparse.Namespace) -> None:
    if args.bootstrap < 0:
        raise UsageError(f"--bootstrap must be 0 or more, got {args.bootstrap}")
    if args.gate and args.bootstrap < MIN_GATE_BOOTSTRAP:
        raise UsageError(f"--bootstrap must be at least {MIN_GATE_BOOTSTRAP} with --gate (fewer give no confidence "
                         f"interval, so no regression could fail the gate), got {args.bootstrap}")


def _cmd_compare(args: argparse.Namespace) -> int:
    from tailguard.bench.compare import run_compare

    rules = _gate_rules(args)
    _check_bootstrap(args)
    a, b = _resolve_results(args.a), _resolve_results(args.b)
    try:
        cmp = run_compare(a, b, rules, html_path=args.html, json_path=args.json_out, reps=args.bootstrap,
                          console=_console())
    except (ValueError, KeyError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot compare {a} and {b}: {exc}") from None
    except OSError as exc:
        raise UsageError(str(exc)) from None
    if args.html:
        _console().print(f"html: {args.html}")
    return EXIT_GATE if args.gate and not cmp["gate"]["pass"] else 0


def _cmd_ab(args: argparse.Namespace) -> int:
    from tailguard.bench.ab import (
        ArmError,
        arms_from_args,
        default_output_dir,
        plan_runs,
        run_ab_sync,
        scales_from,
    )

    try:
        arms = arms_from_args(args.arm, replicas=args.replicas, headers=args.arm_header, keys=args.arm_key,
                              key_envs=args.arm_key_env, models=args.arm_model)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    for name in ("repeats", "sweep_repeats"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("health_timeout", "stop_grace"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    _positive("--pause", args.pause, allow_zero=True)
    if args.health_path is not None and not args.health_path.startswith("/"):
        raise UsageError(f"--health-path is a path such as /health, got {args.health_path!r}")
    try:
        scales = scales_from(args.sweep_scales)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    rules = _gate_rules(args) if args.gate else None
    _check_bootstrap(args)
    cfg = config_from_args(args, target=False)
    if scales and not (cfg.workload == "trace" or cfg.rate):
        raise UsageError("--sweep-scales scales an open-loop schedule in time: use it with --trace or --rate")
    if cfg.workload != "trace" and cfg.trace_speedup != 1:
        raise UsageError("--time-scale speeds up a replayed trace (--trace); with --rate, --sweep-scales multiplies "
                         "the rate")
    if args.sweep_profile:
        from tailguard.bench.profiles import load_profiles

        try:
            sweep_profile = load_profiles([args.sweep_profile])[0].name
        except Exception as exc:  # unknown names, YAML errors alike
            raise UsageError(f"--sweep-profile: {exc}") from None
        if args.sweep_profile not in cfg.profiles:
            cfg.profiles = (*cfg.profiles, args.sweep_profile)
    else:
        sweep_profile = None
    out = Path(args.output_dir) if args.output_dir else default_output_dir()
    console = _console()
    plan = plan_runs([a.name for a in arms], args.repeats, args.order, main_scale=cfg.trace_speedup, scales=scales,
                     sweep_repeats=args.sweep_repeats)
    try:
        result = run_ab_sync(cfg, arms, plan, out, rules=rules, sweep_profile=sweep_profile,
                             health_timeout=args.health_timeout, health_path=args.health_path,
                             stop_grace=args.stop_grace, pause=args.pause, admin_key_env=args.admin_key_env,
                             quiet=args.quiet, console=console, order=args.order)
    except ArmError as exc:
        raise UsageError(str(exc)) from None
    except (ValueError, FileNotFoundError, ConnectionError) as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"cannot write to {out}: {exc}") from None
    results, paths = result
    if not args.quiet:
        from tailguard.bench.ab_report import print_ab_summary

        print_ab_summary(results, console)
        for kind in ("json", "html"):
            console.print(f"{kind:>4}: {paths[kind]}")
    else:
        print(paths["html"])
    if args.gate and not (results.get("gate") or {}).get("pass", True):
        return EXIT_GATE
    if args.fail_on_slo and any((a.get("verdict") or {}).get("pass") is False for a in results["arms"].values()):
        return EXIT_GATE
    return 0


MAX_FAKE_LIFETIME_S = 30 * 86400.0


def _cmd_fake_server(args: argparse.Namespace) -> int:
    from tailguard.bench.fakeserver import FakeScript, ReceivedLogError, run_server

    for name in ("ttft", "itl", "jitter", "spin", "ttft_per_prompt_token"):
        _positive("--" + name.replace("_", "-"), getattr(args, name), allow_zero=True)
    _positive("--max-lifetime", args.max_lifetime)
    if args.max_lifetime > MAX_FAKE_LIFETIME_S:  # an event loop's timer cannot wait for ever
        raise UsageError(f"--max-lifetime must be at most {MAX_FAKE_LIFETIME_S:g} s (30 days), got "
                         f"{args.max_lifetime:g}")
    key_delays, key_itl = _key_seconds("--key-delay", args.key_delay), _key_seconds("--key-itl", args.key_itl)
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be 0..65535, got {args.port}")
    if args.replicas < 0:
        raise UsageError(f"--replicas must be 0 or more, got {args.replicas}")
    script = FakeScript(ttft=args.ttft, itl=args.itl, jitter=args.jitter,
                        ttft_per_prompt_token=args.ttft_per_prompt_token, multi_token_every=args.multi_token_every,
                        multi_token_size=args.multi_token_size, eos_after=args.eos_after,
                        error_every=args.error_every, timeline=not args.no_timeline,
                        accept_fixed_length=not args.reject_fixed_length, spin=args.spin, seed=args.seed,
                        max_lifetime=args.max_lifetime, key_delays=key_delays, key_itl=key_itl,
                        received_log=args.received_log, replicas=args.replicas)

    def ready(port: int) -> None:
        print(f"fake OpenAI-compatible server on http://127.0.0.1:{port} (model 'fake'; exits after "
              f"{script.max_lifetime:.0f} s; Ctrl-C stops it)", flush=True)

    try:
        run_server(script, args.port, ready)
    except ReceivedLogError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"cannot listen on 127.0.0.1:{args.port}: {exc}") from None
    return 0


def _key_seconds(flag: str, items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        key, sep, v = item.rpartition("=")
        try:
            seconds = float(v)
        except ValueError:
            seconds = float("nan")
        if not sep or not key or not math.isfinite(seconds) or seconds < 0:
            raise UsageError(f"{flag} wants KEY=SECONDS with SECONDS >= 0, got {item!r}")
        out[key] = seconds
    return out


# --- the summary table ----------------------------------------------------------------------------------------

def _console():
    from rich.console import Console

    return Console(highlight=False)


def _ms(x: float | None, nd: int = 1) -> str:
    return "n/a" if x is None else f"{x * 1e3:.{nd}f}"


def _pct(entry: dict | None) -> str:
    """A percentile in ms, marked when too few samples lie beyond it to say anything of the tail."""
    entry = entry or {}
    text = _ms(entry.get("value"), 2)
    return text + " ⚠" if entry.get("enough_samples") is False else text


def class_table(results: dict):
    """Per traffic class and for the whole: requests, shares, TTFT/ITL/E2E P50/P95/P99, goodput, verdicts."""
    from rich.table import Table

    cl = results["classes"]
    how = f"the trace's {cl.get('column')} column" if cl["assignment"] == "column" else "drawn by share"
    t = Table(title=f"traffic classes ({how})")
    for c in ("class", "share", "n", "failed"):
        t.add_column(c, justify="left" if c == "class" else "right")
    for m in ("TTFT", "ITL", "E2E"):
        t.add_column(f"{m} P50/P95/P99 ms", justify="right")
    t.add_column("verdicts (goodput req/s)", justify="left")

    def pcts(metrics: dict, name: str) -> str:
        pc = ((metrics.get(name) or {}).get("percentiles")) or {}
        return "/".join(_ms((pc.get(q) or {}).get("value"), 1) for q in ("p50", "p95", "p99"))

    def verdicts(slo: dict) -> str:
        parts = []
        for name, v in slo.items():
            mark = ("[green]PASS[/]" if v["pass"] else "[red]FAIL[/]") if v.get("evaluated") else "[dim]n/a[/]"
            gp = v.get("goodput_rps")
            parts.append(f"{name} {mark} ({'n/a' if gp is None else f'{gp:.2f}'})")
        return ", ".join(parts)

    for name, d in cl["by_class"].items():
        r = d["requests"]
        share = f"{(d['share_sent'] or 0) * 100:.1f}%"
        if d.get("share_planned") is not None:
            share += f" of {d['share_planned'] * 100:.3g}%"
        t.add_row(name, share, str(r["measured"]), str(r["failed"]), *(pcts(d["metrics"], m) for m in
                                                                         ("ttft", "itl", "e2e")),
                  verdicts(d["slo"]))
    s = results["summary"]["requests"]
    t.add_row("[bold]all[/]", "100%", str(s["measured"]), str(s["failed"]),
              *(pcts(results["metrics"], m) for m in ("ttft", "itl", "e2e")), verdicts(results.get("slo") or {}))
    return t


def print_summary(results: dict, console=None) -> None:
    """The end-of-run table: percentiles with CIs, throughput, verdicts, stages and warnings."""
    from rich.table import Table

    from tailguard.bench.report import sentence

    console = console or _console()
    s = results["summary"]
    tp = s["throughput"]
    run = results["run"]
    t = Table(title=f"tailguard bench: {run['target']['model']} at {run['target']['url']} ({run['id']})")
    t.add_column("metric", justify="left")
    t.add_column("n", justify="right")
    t.add_column("mean ms", justify="right")
    for q in ("P50", "P90", "P95", "P99", "P99.9"):
        t.add_column(f"{q} ms", justify="right")
    t.add_column("P99 95% CI", justify="right")
    t.add_column("failed excl.", justify="right")
    names = {"ttft": "TTFT", "itl": "ITL", "tpot": "TPOT", "e2e": "E2E"}
    for k, label in names.items():
        d = results["metrics"].get(k) or {}
        if not d.get("count"):
            continue
        pc = d.get("percentiles") or {}
        cells = [_pct(pc.get(q)) for q in ("p50", "p90", "p95", "p99", "p99.9")]
        ci = (pc.get("p99") or {}).get("ci")
        cells.append(f"{_ms(ci[0], 1)}–{_ms(ci[1], 1)}" if ci else "n/a")
        cells.append(str(d.get("excluded_failures", 0)))
        t.add_row(label, str(d["count"]), _ms(d.get("mean"), 2), *cells)
    console.print(t)
    if any((pc or {}).get("enough_samples") is False for d in results["metrics"].values() if isinstance(d, dict)
           for pc in (d.get("percentiles") or {}).values()):
        console.print("[dim]⚠: fewer samples than a tail estimate needs (Pq needs at least 100/(100-q): "
                      "P99 100, P99.9 1,000)[/]")
    pf = s.get("percentile_failures") or {}
    if pf.get("failed"):
        console.print(f"[yellow]{pf['note']}[/]")
    else:
        console.print("[dim]no request failed: every measured request is in the percentiles[/]")
    r = s["requests"]
    console.print(f"{r['completed']}/{r['measured']} requests completed ({r['warmup']} warm-up excluded, "
                  f"{r['failed']} failed) in {s['duration_s']:.2f} s: [bold]{(tp['requests_per_s'] or 0):.2f} "
                  f"req/s[/], {(tp['output_tokens_per_s'] or 0):.1f} output tokens/s, error rate "
                  f"{(s['error_rate'] or 0) * 100:.2f}%")
    st = results.get("stages") or {}
    if st.get("mode") not in (None, "none"):
        labels = st.get("labels") or {}
        share = st.get("share_of_e2e") or {}
        parts = ", ".join(f"{labels.get(k, k)} {share.get(k, 0) * 100:.0f}%" for k in st["stages"])
        console.print(f"where the time goes ({st['mode']} split): {parts}")
    v = Table(title="SLO verdicts")
    for c in ("profile", "verdict", "goodput req/s", "failed checks"):
        v.add_column(c, justify="left")
    for name, res in (results.get("slo") or {}).items():
        verdict = ("[green]PASS[/]" if res["pass"] else "[red]FAIL[/]") if res["evaluated"] else "[dim]n/a[/]"
        failed = "; ".join(c["objective"] for c in res["checks"] if c["status"] == "fail")
        gp = res.get("goodput_rps")
        v.add_row(name, verdict, "n/a" if gp is None else f"{gp:.2f}", failed or "none")
    console.print(v)
    if results.get("classes"):
        console.print(class_table(results))
    for a in results.get("advisories") or []:
        if a.get("fired"):
            console.print(f"[yellow]advisory[/] {a['metric'].upper()} {a['rule']} (ratio {a['ratio']:.2f}, "
                          f"{a['severity']}): {a['action']}")
    for w in results.get("warnings") or []:
        console.print(f"[yellow]warning[/] {sentence(w)}")
