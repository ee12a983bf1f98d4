"""``tailguard demo``: the main job on the embedded model, end to end, as a user would run it.

1. start ``tailguard serve`` on SmolLM2-135M-Instruct (in this process, on an ephemeral 127.0.0.1 port);
2. send a burst of concurrent streaming chat requests, Chinese and English, over HTTP;
3. read each request's record back from the server (``GET /v1/requests/{id}``) and print its stages;
4. run ``tailguard bench`` against the same server (open-loop Poisson load, stage join, SLO verdicts);
5. write an HTML report (the burst's timelines, plus the bench report) that opens offline.

Every figure comes from the server's monotonic timeline (docs/metrics.md); the client's own view is printed beside it.
"""

from __future__ import annotations

import asyncio
import html
import json
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tailguard.observe.timeline import STAGES

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
STAGE_COLORS = {"tokenize": "#9467bd", "queue": "#d62728", "prefill": "#ff7f0e", "decode": "#1f77b4",
                "stream": "#2ca02c"}


@dataclass
class DemoRecord:
    request_id: str
    prompt: str
    prompt_tokens: int
    output_tokens: int
    stages: dict[str, float]
    ttft_s: float
    e2e_s: float
    tpot_s: float
    client_ttft_s: float
    client_e2e_s: float
    finish_reason: str
    output: str
    start_offset_s: float


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


async def _one(client, url: str, model: str, run: str, idx: int, prompt: str, max_tokens: int,
               t0: float) -> DemoRecord:
    rid = f"demo-{run}-{idx:03d}"
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
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
    done = time.perf_counter()
    rec = await _record(client, url, rid)
    return DemoRecord(
        request_id=rid, prompt=prompt, prompt_tokens=rec["prompt_tokens"], output_tokens=rec["output_tokens"],
        stages=rec["stages"], ttft_s=rec["ttft"] or 0.0, e2e_s=rec["e2e"], tpot_s=rec["tpot"] or 0.0,
        client_ttft_s=(first or done) - sent, client_e2e_s=done - sent, finish_reason=finish,
        output="".join(parts), start_offset_s=sent - t0,
    )


async def _burst(url: str, model: str, n: int, max_tokens: int, console: Console,
                 admin_key: str) -> list[DemoRecord]:
    import httpx

    t0 = time.perf_counter()
    run = time.strftime("%H%M%S")  # the store keeps earlier runs' records: keep this run's IDs apart
    columns = (TextColumn("[bold]burst"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    auth = {"Authorization": f"Bearer {admin_key}"}
    async with httpx.AsyncClient(timeout=600, limits=limits, headers=auth) as client:
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("requests", total=n)

            async def tracked(i: int) -> DemoRecord:
                rec = await _one(client, url, model, run, i, DEMO_PROMPTS[i % len(DEMO_PROMPTS)], max_tokens, t0)
                progress.advance(task)
                return rec

            return list(await asyncio.gather(*(tracked(i) for i in range(n))))


def _burst_figure(records: list[DemoRecord]):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=2, cols=1, row_heights=[0.7, 0.3], vertical_spacing=0.1,
                        subplot_titles=("Where each request spent its time (seconds since the burst began)",
                                        "Share of all end-to-end time by stage"))
    names = [r.request_id for r in records]
    base = [r.start_offset_s for r in records]
    for stage in STAGES:
        widths = [r.stages[stage] for r in records]
        fig.add_trace(go.Bar(y=names, x=widths, base=base, orientation="h", name=stage,
                             marker_color=STAGE_COLORS[stage],
                             hovertemplate="%{y} " + stage + ": %{x:.3f} s<extra></extra>"), row=1, col=1)
        base = [b + w for b, w in zip(base, widths)]
    totals = {s: sum(r.stages[s] for r in records) for s in STAGES}
    whole = sum(totals.values()) or 1.0
    fig.add_trace(go.Bar(x=list(totals), y=[v / whole for v in totals.values()], showlegend=False,
                         marker_color=[STAGE_COLORS[s] for s in totals]), row=2, col=1)
    fig.update_yaxes(autorange="reversed", row=1, col=1)
    fig.update_yaxes(tickformat=".0%", row=2, col=1)
    fig.update_layout(barmode="overlay", height=360 + 22 * len(records),
                      title="A burst of concurrent chat requests through tailguard serve")
    return fig


def write_report(records: list[DemoRecord], summary: dict, path: Path, bench_report: Path | None) -> None:
    fig = _burst_figure(records)
    rows = "".join(
        f"<tr><td>{r.request_id}</td><td>{r.prompt_tokens}</td><td>{r.output_tokens}</td>"
        + "".join(f"<td>{r.stages[s] * 1000:.0f}</td>" for s in STAGES)
        + f"<td>{r.ttft_s * 1000:.0f}</td><td>{r.e2e_s * 1000:.0f}</td><td>{html.escape(r.output[:80])}</td></tr>"
        for r in records
    )
    stats = "".join(f"<li>{k}: P50 {v['p50'] * 1000:.0f} ms, P95 {v['p95'] * 1000:.0f} ms, "
                    f"P99 {v['p99'] * 1000:.0f} ms</li>" for k, v in summary["percentiles"].items())
    bench = (f"<h2>Load test</h2><p>The bench run against the same server: <a href='{bench_report.as_posix()}'>"
             f"{html.escape(bench_report.as_posix())}</a> (CDFs, latency over time, stage breakdown, Sankey, "
             "SLO verdicts).</p>") if bench_report else ""
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>tailguard demo</title></head>"
        "<body style='font-family:sans-serif;max-width:1200px;margin:auto'>"
        f"<h1>tailguard demo</h1><p>{summary['requests']} concurrent streaming chat requests to "
        f"<code>tailguard serve</code> on {html.escape(summary['model'])} ({summary['weight_format']}, "
        f"{summary['device']}); {summary['output_tokens']} tokens in {summary['wall_s']:.2f} s = "
        f"{summary['tokens_per_s']:.1f} tokens/s. Stages from the server's own timeline (docs/metrics.md).</p>"
        f"<ul>{stats}</ul>" + fig.to_html(full_html=False, include_plotlyjs=True) + bench
        + "<h2>Requests (ms)</h2><table border=1 cellpadding=4><tr><th>id</th><th>in</th><th>out</th>"
        + "".join(f"<th>{s}</th>" for s in STAGES) + "<th>TTFT</th><th>E2E</th><th>output</th></tr>" + rows
        + "</table></body></html>"
    )
    path.write_text(page, encoding="utf-8")


def _table(records: list[DemoRecord]) -> Table:
    table = Table(title=f"{len(records)} concurrent streaming chat requests: the server's stages (ms)")
    cols = ("id", "in", "out", *STAGES, "TTFT", "E2E", "client E2E")
    for col in cols:
        table.add_column(col, justify="left" if col == "id" else "right", no_wrap=True)
    table.add_column("output", no_wrap=True, overflow="ellipsis", max_width=28)
    for r in records:
        table.add_row(r.request_id, str(r.prompt_tokens), str(r.output_tokens),
                      *(f"{r.stages[s] * 1000:.0f}" for s in STAGES), f"{r.ttft_s * 1000:.0f}",
                      f"{r.e2e_s * 1000:.0f}", f"{r.client_e2e_s * 1000:.0f}", r.output[:40].replace("\n", " "))
    return table


def _run_bench(url: str, model: str, args, out_dir: Path, console: Console) -> Path | None:
    """A short open-loop bench run against the demo server; returns its report's path."""
    from tailguard.bench.cli import print_summary
    from tailguard.bench.runner import BenchConfig, run_sync

    cfg = BenchConfig(url=url, model=model, rate=args.bench_rate, num_requests=args.bench_requests,
                      input_tokens=64, output_tokens=args.bench_output_tokens, langs=("en", "zh"), warmup_requests=2,
                      output_dir=str(out_dir), business_type="demo", bootstrap=300, label="demo")
    console.rule("[bold]tailguard bench against the demo server")
    results, _ = run_sync(cfg)
    print_summary(results, console)
    report = out_dir / "report.html"
    return report if report.exists() else None


def run_demo(args) -> int:
    from tailguard.engine.engine import AsyncLLMEngine
    from tailguard.engine_options import engine_args_from
    from tailguard.serving.config import ServerConfig
    from tailguard.serving.server import ThreadedServer

    console = Console(width=max(Console().width, 140))
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with console.status(f"loading {args.model} ..."):
        engine = AsyncLLMEngine.from_args(engine_args_from(args))
    # The demo reads every record back (an admin surface): its own server gets a one-off admin key.
    admin_key = secrets.token_urlsafe(24)
    config = ServerConfig(model=args.model, host="127.0.0.1", port=0, access_log=False, log_level="warning",
                          store_path=str(out_dir / "requests.sqlite3"), admin_key=admin_key)
    bench_report = None
    try:
        with ThreadedServer(config, engine) as server:
            model = server.state.model_names[0]
            console.print(f"tailguard serve: {engine.model_name} on {engine.engine.device}, weights "
                          f"{args.weight_format}, at {server.url} (store {config.store_path})")
            t0 = time.perf_counter()
            records = asyncio.run(_burst(server.url, model, args.requests, args.max_tokens, console, admin_key))
            wall = time.perf_counter() - t0
            console.print(_table(records))
            if args.bench_requests > 0:
                bench_report = _run_bench(server.url, model, args, out_dir / "bench", console)
    finally:
        engine.shutdown()
    out_tokens = sum(r.output_tokens for r in records)
    summary = {
        "model": engine.model_name, "weight_format": args.weight_format, "device": str(engine.engine.device),
        "requests": len(records), "output_tokens": out_tokens, "wall_s": wall, "tokens_per_s": out_tokens / wall,
        "percentiles": {"TTFT": _percentiles([r.ttft_s for r in records]),
                        "E2E": _percentiles([r.e2e_s for r in records]),
                        "TPOT": _percentiles([r.tpot_s for r in records]),
                        "queue": _percentiles([r.stages["queue"] for r in records])},
    }
    console.rule("[bold]the burst")
    for name, p in summary["percentiles"].items():
        console.print(f"{name:5s} P50 {p['p50'] * 1000:7.0f} ms   P95 {p['p95'] * 1000:7.0f} ms   "
                      f"P99 {p['p99'] * 1000:7.0f} ms")
    console.print(f"{out_tokens} output tokens in {wall:.2f} s = {out_tokens / wall:.1f} tokens/s aggregate")
    (out_dir / "results.json").write_text(json.dumps({"summary": summary, "requests": [asdict(r) for r in records]},
                                                     indent=2, ensure_ascii=False))
    report = out_dir / "report.html"
    write_report(records, summary, report, bench_report.relative_to(out_dir) if bench_report else None)
    console.print(f"[bold green]report:[/] {report.resolve()}")
    if bench_report:
        console.print(f"[bold green]bench report:[/] {bench_report.resolve()}")
    return 0
