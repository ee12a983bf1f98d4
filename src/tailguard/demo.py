"""``tailguard demo``: the main job on the embedded model, end to end, as a user would run it.

1. start ``tailguard serve`` on SmolLM2-135M-Instruct (in this process, on an ephemeral 127.0.0.1 port);
2. warm it up (a few requests of other prompts), wait until it is idle and, for a while, until the host is quiet;
3. send a burst of concurrent streaming chat requests, Chinese and English, over HTTP;
4. read each request's record back from the server (``GET /v1/requests/{id}``) and print its stages;
5. run ``tailguard bench`` against the same server (open-loop Poisson load, stage join, SLO verdicts);
6. write an HTML report (each request's timeline, the machine, what the run shows) that opens offline.

Every figure comes from the server's monotonic timeline (docs/metrics.md); the client's own view is printed beside it.
What the rest of the host used meanwhile (other processes' CPU, from /proc/stat) is measured and reported with it.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tailguard.demo_report import (
    DemoRecord,
    HostLoad,
    clip,
    describe_hardware,
    describe_load,
    explain_slo,
    gap_threshold,
    hardware,
    language,
    prefill_spans,
    segments,
    sentence,
    split,
    step_ends,
    what_to_look_at,
    write_report,
)

__all__ = ["DEMO_PROMPTS", "DemoRecord", "run_demo", "write_report"]

DEMO_PROMPTS = [
    "What is the capital of France?",
    "请用一句话介绍一下北京。",
    "Write a haiku about the sea.",
    "什么是机器学习？",
    "Give me three tips for writing clean Python code.",
    "请解释一下为什么天空是蓝色的。",
    "Explain what a KV cache is in one paragraph.",
    "推荐三本适合初学者的编程书。",
]
# Warm-up requests: a system prompt of their own, so that the prefix cache holds nothing the burst's prompts share
# (SmolLM2's template otherwise puts its default system prompt first), in both languages, as many as the burst so
# that the batch shapes and the client's keep-alive connections are the burst's.
WARMUP_SYSTEM = "Warm-up request of a benchmark: reply with one word."
WARMUP_PROMPTS = ["Say hello.", "用一个词回答：你好吗？"]
WARMUP_MAX_TOKENS = 6
# Before the burst, wait up to this long for the rest of the host to use less than QUIET_CORES; then go on anyway
# (and say so): a demo must end, and the load measured during the burst is reported with its figures.
QUIET_CORES = 0.5
QUIET_WAIT_S = 10.0
QUIET_WINDOW_S = 0.5


def _percentiles(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=float)
    return {f"p{q}": float(np.percentile(arr, q)) for q in (50, 95, 99)}


async def _record(client, url: str, rid: str) -> dict[str, Any]:
    """The server's record of ``rid``: it closes just after the last byte, so wait briefly for it."""
    deadline = time.monotonic() + 10
    while True:
        resp = await client.get(f"{url}/v1/requests/{rid}")
        if resp.status_code == 200:
            return resp.json()
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server kept no record of {rid}: {resp.status_code} {resp.text[:200]}")
        await asyncio.sleep(0.02)


async def _stream(client, url: str, model: str, rid: str, messages: list[dict], max_tokens: int) -> dict[str, Any]:
    """One streaming chat request; the client's own view of it (perf_counter times)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "seed": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first, parts, finish = None, [], ""
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                             headers={"X-Request-ID": rid, "X-Business-Type": "demo"}) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{rid}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    if first is None:
                        first = time.perf_counter()
                    parts.append(text)
                finish = choice.get("finish_reason") or finish
    return {"sent": sent, "first": first, "done": time.perf_counter(), "output": "".join(parts), "finish": finish}


def to_record(rid: str, prompt: str, client: dict[str, Any], rec: dict[str, Any], t0: float) -> DemoRecord:
    """Join the client's view of a request with the server's record; times relative to the burst's start ``t0``."""
    ts = dict(rec.get("timestamps") or {})
    received = ts.pop("received_monotonic", None)  # perf_counter of the server: the same clock as ours
    done = client["done"]
    return DemoRecord(
        request_id=rid, prompt=prompt, prompt_tokens=rec["prompt_tokens"], output_tokens=rec["output_tokens"],
        stages=rec["stages"], ttft_s=rec["ttft"] or 0.0, e2e_s=rec["e2e"], tpot_s=rec["tpot"] or 0.0,
        client_ttft_s=(client["first"] or done) - client["sent"], client_e2e_s=done - client["sent"],
        finish_reason=client["finish"], output=client["output"], start_offset_s=client["sent"] - t0,
        lang=language(prompt), received_offset_s=None if received is None else received - t0, timestamps=ts,
        token_times=list(rec.get("token_times") or []), token_sent=list(rec.get("token_sent") or []),
        cached_prompt_tokens=rec.get("cached_prompt_tokens") or 0, preemptions=rec.get("preemptions") or 0,
    )


async def _wait_idle(idle: Callable[[], bool], timeout: float = 30.0) -> float:
    """Wait until the engine holds no request (the warm-up's last steps done); returns the seconds waited."""
    began = time.monotonic()
    while not idle() and time.monotonic() - began < timeout:
        await asyncio.sleep(0.01)
    return time.monotonic() - began


async def wait_quiet(max_wait_s: float | None = None, cores: float = QUIET_CORES,
                     window_s: float = QUIET_WINDOW_S) -> dict[str, Any]:
    """Wait (at most ``max_wait_s``, default QUIET_WAIT_S) until other processes use less than ``cores`` of the
    host's CPUs."""
    max_wait_s = QUIET_WAIT_S if max_wait_s is None else max_wait_s
    began = time.monotonic()
    last: dict[str, float] | None = None
    while True:
        probe = HostLoad().__enter__()
        await asyncio.sleep(window_s)
        last = probe.measure()
        if last is None or last["others_cores"] < cores or time.monotonic() - began >= max_wait_s:
            break
    return {"waited_s": time.monotonic() - began, "others_cores": None if last is None else last["others_cores"],
            "quiet": last is None or last["others_cores"] < cores, "threshold_cores": cores}


async def _session(url: str, model: str, n: int, max_tokens: int, console: Console, admin_key: str,
                   idle: Callable[[], bool], steps: Callable[[], int]) -> tuple[list[DemoRecord], dict[str, Any]]:
    """Warm-up, waits, then the burst; returns the burst's records and what was measured around it."""
    import httpx

    run = time.strftime("%H%M%S")  # the store keeps earlier runs' records: keep this run's IDs apart
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    auth = {"Authorization": f"Bearer {admin_key}"}
    info: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=600, limits=limits, headers=auth) as client:
        # Warm-up: the first requests of a process pay one-off costs (the tokenizer's and template's first use, the
        # kernels' thread pool and buffers for a batch of this size, the client's connections); off the burst.
        began = time.perf_counter()
        await asyncio.gather(*(
            _stream(client, url, model, f"demo-{run}-warmup-{i:03d}",
                    [{"role": "system", "content": WARMUP_SYSTEM},
                     {"role": "user", "content": WARMUP_PROMPTS[i % len(WARMUP_PROMPTS)]}], WARMUP_MAX_TOKENS)
            for i in range(n)))
        info["warmup_s"] = time.perf_counter() - began
        info["idle_wait_s"] = await _wait_idle(idle)
        with console.status("waiting for the host to be quiet ..."):
            info["quiet"] = await wait_quiet()
        gc.collect()  # a full collection now rather than in the middle of the burst

        columns = (TextColumn("[bold]burst"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        prompts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(n)]
        rids = [f"demo-{run}-{i:03d}" for i in range(n)]
        steps_before = steps()
        with Progress(*columns, console=console) as progress, HostLoad() as load:
            task = progress.add_task("requests", total=n)

            async def tracked(i: int) -> dict[str, Any]:
                out = await _stream(client, url, model, rids[i], [{"role": "user", "content": prompts[i]}],
                                    max_tokens)
                progress.advance(task)
                return out

            t0 = time.perf_counter()
            views = list(await asyncio.gather(*(tracked(i) for i in range(n))))
            info["wall_s"] = max(v["done"] for v in views) - t0
        info["host_load"] = load.result
        info["engine_steps"] = steps() - steps_before
        # The records are read after the burst, so that these reads do not compete with it.
        recs = await asyncio.gather(*(_record(client, url, rid) for rid in rids))
    return [to_record(rid, p, v, r, t0) for rid, p, v, r in zip(rids, prompts, views, recs)], info


# The console table's columns, and the narrowest console each one is shown on: a narrow terminal drops the extras
# rather than wrap or cut the request ids.
TABLE_COLUMNS = {"id": 0, "lang": 130, "in": 130, "out": 0, "tokenize": 130, "queue": 0, "prefill": 0, "waiting": 0,
                 "decode": 0, "gaps": 0, "stream": 130, "TTFT": 0, "E2E": 0, "client E2E": 150, "output": 175}


def _table(records: list[DemoRecord], width: int) -> Table:
    table = Table(title=f"{len(records)} concurrent streaming chat requests: the server's stages (ms)",
                  box=box.HEAVY_HEAD if width >= 130 else box.SIMPLE_HEAD,
                  padding=(0, 1) if width >= 130 else (0, 0))
    cols = [c for c, min_width in TABLE_COLUMNS.items() if width >= min_width]
    steps, threshold = step_ends(records), gap_threshold(records)
    prefills = prefill_spans(records)
    rows = []
    for r in records:
        t = split(r, segments(r, steps, threshold, prefills))
        ms = lambda s: f"{s * 1000:.0f}"  # noqa: E731
        cells = {"id": r.request_id, "lang": r.lang, "in": str(r.prompt_tokens), "out": str(r.output_tokens),
                 "tokenize": ms(t["tokenize"]), "queue": ms(t["queue"]),
                 "prefill": f"{ms(t['prefill'])}/{t['prefill steps']}", "waiting": ms(t["waiting"]),
                 "decode": ms(t["decode"]), "gaps": f"{ms(t['decode gap'])}/{t['gaps']}", "stream": ms(t["stream"]),
                 "TTFT": ms(r.ttft_s), "E2E": ms(r.e2e_s), "client E2E": ms(r.client_e2e_s),
                 "output": clip(r.output, 60)}
        rows.append([cells[c] for c in cols])
    for i, col in enumerate(cols):
        if col == "output":
            table.add_column(col, no_wrap=True, overflow="ellipsis", max_width=max(12, width - 150))
        else:  # as wide as its widest cell: ids and figures are never wrapped or cut
            table.add_column(col, justify="left" if col in ("id", "lang") else "right", no_wrap=True,
                             min_width=max([len(col)] + [len(row[i]) for row in rows]))
    for row in rows:
        table.add_row(*row)
    table.caption = ("prefill: ms/engine steps; waiting: first token made -> first sent; decode: steady steps; "
                     "gaps: ms/count of token intervals over 3x the burst's median (hover them in the report for why)")
    return table


def _run_bench(url: str, model: str, args, out_dir: Path, console: Console) -> tuple[Path | None, dict | None]:
    """A short open-loop bench run against the demo server; returns its report's path and its results."""
    from tailguard.bench.cli import print_summary
    from tailguard.bench.runner import BenchConfig, run_sync

    cfg = BenchConfig(url=url, model=model, rate=args.bench_rate, num_requests=args.bench_requests,
                      input_tokens=64, output_tokens=args.bench_output_tokens, langs=("en", "zh"), warmup_requests=2,
                      output_dir=str(out_dir), business_type="demo", bootstrap=300, label="demo")
    console.rule("[bold]tailguard bench against the demo server")
    results, _ = run_sync(cfg)
    print_summary(results, console)
    report = out_dir / "report.html"
    return (report if report.exists() else None), results


def _console() -> Console:
    # A terminal gets its own width (wider lines would wrap there); a file or pipe gets room for the whole table.
    probe = Console()
    return probe if probe.is_terminal else Console(width=170)


def _argument_problem(args) -> str | None:
    """What is wrong with the demo's arguments, in one line, found before the model loads (and the output directory
    made, where it can be), or None."""
    from tailguard.engine_options import EngineOptionError, check_engine_args, check_model, engine_args_from

    for flag, value, least in (("--requests", args.requests, 1), ("--max-tokens", args.max_tokens, 1),
                               ("--bench-requests", args.bench_requests, 0),
                               ("--bench-output-tokens", args.bench_output_tokens, 1)):
        if value < least:
            return f"{flag} must be at least {least}, not {value}"
    if not (math.isfinite(args.bench_rate) and args.bench_rate > 0):
        return f"--bench-rate must be a positive number of requests per second, not {args.bench_rate}"
    try:
        check_model(args.model)
        check_engine_args(engine_args_from(args))
    except EngineOptionError as exc:
        return str(exc)
    try:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot make the output directory {args.output_dir}: {exc.strerror or exc}"
    return None


def run_demo(args) -> int:
    from tailguard.engine.engine import AsyncLLMEngine
    from tailguard.engine_options import engine_args_from
    from tailguard.serving.config import ServerConfig
    from tailguard.serving.server import ThreadedServer

    problem = _argument_problem(args)
    if problem is not None:
        print(f"tailguard demo: {problem}", file=sys.stderr)
        return 2
    console = _console()
    out_dir = Path(args.output_dir)
    with console.status(f"loading {args.model} ..."):
        began = time.perf_counter()
        engine = AsyncLLMEngine.from_args(engine_args_from(args))
        load_s = time.perf_counter() - began  # a first run compiles the kernels here, outside the burst
    hw = hardware(str(engine.engine.device))
    # The demo reads every record back (an admin surface): its own server gets a one-off admin key.
    admin_key = secrets.token_urlsafe(24)
    config = ServerConfig(model=args.model, host="127.0.0.1", port=0, access_log=False, log_level="warning",
                          store_path=str(out_dir / "requests.sqlite3"), admin_key=admin_key)
    bench_report, bench, bench_load = None, None, None

    def idle() -> bool:
        s = engine.stats()
        return s.running == 0 and s.waiting == 0

    try:
        with ThreadedServer(config, engine) as server:
            model = server.state.model_names[0]
            console.print(f"tailguard serve: {engine.model_name} on {engine.engine.device}, weights "
                          f"{args.weight_format}, loaded in {load_s:.1f} s, at {server.url} (store {config.store_path})")
            records, info = asyncio.run(_session(server.url, model, args.requests, args.max_tokens, console,
                                                 admin_key, idle, lambda: engine.stats().steps))
            console.print(_table(records, console.width))
            if args.bench_requests > 0:
                with HostLoad() as load:
                    bench_report, bench = _run_bench(server.url, model, args, out_dir / "bench", console)
                bench_load = load.result
    finally:
        engine.shutdown()
    wall = info["wall_s"]
    out_tokens = sum(r.output_tokens for r in records)
    quiet = info["quiet"]
    warmup_note = (f"Before the burst: {args.requests} warm-up requests of other prompts ({info['warmup_s']:.2f} s), "
                   f"so that first-use costs stay out of it; then a wait of {quiet['waited_s']:.1f} s for the host "
                   + ("to be quiet." if quiet["quiet"] else
                      f"to be quiet, which it did not become (other processes still used "
                      f"{quiet['others_cores']:.2f} cores)."))
    summary = {
        "model": engine.model_name, "weight_format": args.weight_format, "device": str(engine.engine.device),
        "requests": len(records), "output_tokens": out_tokens, "wall_s": wall, "tokens_per_s": out_tokens / wall,
        "engine_steps": info["engine_steps"], "load_s": load_s, "hardware": hw, "host_load": info["host_load"],
        "warmup_s": info["warmup_s"], "idle_wait_s": info["idle_wait_s"], "quiet_wait": quiet,
        "warmup_note": warmup_note, "bench_host_load": bench_load,
        "percentiles": {"TTFT": _percentiles([r.ttft_s for r in records]),
                        "E2E": _percentiles([r.e2e_s for r in records]),
                        "TPOT": _percentiles([r.tpot_s for r in records]),
                        "queue": _percentiles([r.stages["queue"] for r in records])},
    }
    console.rule("[bold]the burst")
    for name, p in summary["percentiles"].items():
        console.print(f"{name:5s} P50 {p['p50'] * 1000:7.0f} ms   P95 {p['p95'] * 1000:7.0f} ms   "
                      f"P99 {p['p99'] * 1000:7.0f} ms")
    console.print(f"{out_tokens} output tokens in {wall:.2f} s = {out_tokens / wall:.1f} tokens/s aggregate, "
                  f"{info['engine_steps']} engine steps")
    console.rule("[bold]what this run shows")
    console.print(f"hardware: {describe_hardware(hw)}")
    console.print(sentence(describe_load(info["host_load"], "the burst")))
    if bench_load:
        console.print(sentence(describe_load(bench_load, "the bench run")))
    console.print(warmup_note)
    for line in what_to_look_at(records):
        console.print(line)
    for line in explain_slo(bench, hw) if bench else []:
        console.print(line)
    (out_dir / "results.json").write_text(json.dumps({"summary": summary, "requests": [asdict(r) for r in records]},
                                                     indent=2, ensure_ascii=False))
    report = out_dir / "report.html"
    write_report(records, summary, report, bench_report.relative_to(out_dir) if bench_report else None, bench)
    console.print(f"[bold green]report:[/] {report.resolve()}")
    if bench_report:
        console.print(f"[bold green]bench report:[/] {bench_report.resolve()}")
    return 0
