"""``tailguard demo``: a burst of concurrent chat requests through the embedded engine, timed and reported.

Each request's stages come from the engine's monotonic timestamps: queue (arrival -> first scheduled), prefill
(first scheduled -> first token) and decode (first token -> last token). The HTML report opens offline.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

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


@dataclass
class DemoRecord:
    request_id: str
    prompt: str
    prompt_tokens: int
    output_tokens: int
    queue_s: float
    prefill_s: float
    decode_s: float
    ttft_s: float
    e2e_s: float
    tpot_s: float
    finish_reason: str
    output: str
    start_offset_s: float


def _percentiles(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values)
    return {f"p{q}": float(np.percentile(arr, q)) for q in (50, 95, 99)}


async def _one(engine, idx: int, prompt: str, max_tokens: int, t0: float, progress, task) -> DemoRecord:
    from tailguard.engine.request import SamplingParams

    arrival = time.perf_counter()
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    text, last = [], None
    async for ev in engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0), f"demo-{idx}", 0, arrival):
        text.append(ev.text)
        if ev.finished:
            last = ev
    progress.advance(task)
    finished = last.time
    ttft = last.first_token - arrival
    n_out = last.num_output_tokens
    return DemoRecord(
        request_id=f"demo-{idx}",
        prompt=prompt,
        prompt_tokens=last.num_prompt_tokens,
        output_tokens=n_out,
        queue_s=last.first_scheduled - arrival,
        prefill_s=last.first_token - last.first_scheduled,
        decode_s=finished - last.first_token,
        ttft_s=ttft,
        e2e_s=finished - arrival,
        tpot_s=(finished - arrival - ttft) / (n_out - 1) if n_out > 1 else 0.0,
        finish_reason=last.finish_reason.value,
        output="".join(text),
        start_offset_s=arrival - t0,
    )


async def _burst(engine, n: int, max_tokens: int, console: Console) -> list[DemoRecord]:
    t0 = time.perf_counter()
    columns = (TextColumn("[bold]burst"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("requests", total=n)
        prompts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(n)]
        return await asyncio.gather(*(_one(engine, i, p, max_tokens, t0, progress, task) for i, p in enumerate(prompts)))


def write_report(records: list[DemoRecord], summary: dict, path: Path) -> None:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=2, cols=1, row_heights=[0.65, 0.35], vertical_spacing=0.12,
        subplot_titles=("Where each request spent its time (seconds since the burst began)", "Stage share of end-to-end latency"),
    )
    names = [r.request_id for r in records]
    colors = {"queue": "#d62728", "prefill": "#ff7f0e", "decode": "#1f77b4"}
    base = [r.start_offset_s for r in records]
    for stage in ("queue", "prefill", "decode"):
        widths = [getattr(r, f"{stage}_s") for r in records]
        fig.add_trace(go.Bar(y=names, x=widths, base=base, orientation="h", name=stage, marker_color=colors[stage],
                             hovertemplate="%{y} " + stage + ": %{x:.3f}s<extra></extra>"), row=1, col=1)
        base = [b + w for b, w in zip(base, widths)]
    totals = {s: sum(getattr(r, f"{s}_s") for r in records) for s in colors}
    fig.add_trace(go.Bar(x=list(totals), y=[v / sum(totals.values()) for v in totals.values()],
                         marker_color=list(colors.values()), showlegend=False), row=2, col=1)
    fig.update_yaxes(autorange="reversed", row=1, col=1)
    fig.update_yaxes(tickformat=".0%", row=2, col=1)
    fig.update_layout(barmode="overlay", height=300 + 22 * len(records), title="tailguard demo: a burst on the embedded engine")
    rows = "".join(
        f"<tr><td>{r.request_id}</td><td>{r.prompt_tokens}</td><td>{r.output_tokens}</td><td>{r.queue_s * 1000:.0f}</td>"
        f"<td>{r.prefill_s * 1000:.0f}</td><td>{r.decode_s * 1000:.0f}</td><td>{r.ttft_s * 1000:.0f}</td>"
        f"<td>{r.e2e_s * 1000:.0f}</td><td>{_escape(r.output[:80])}</td></tr>"
        for r in records
    )
    stats = "".join(f"<li>{k}: P50 {v['p50'] * 1000:.0f} ms, P95 {v['p95'] * 1000:.0f} ms, P99 {v['p99'] * 1000:.0f} ms</li>"
                    for k, v in summary["percentiles"].items())
    html = (
        "<html><head><meta charset='utf-8'><title>tailguard demo</title></head><body style='font-family:sans-serif'>"
        f"<h1>tailguard demo</h1><p>{summary['requests']} concurrent requests on {summary['model']} "
        f"({summary['weight_format']}, {summary['device']}); {summary['output_tokens']} tokens in {summary['wall_s']:.2f} s "
        f"= {summary['tokens_per_s']:.1f} tokens/s.</p><ul>{stats}</ul>"
        + fig.to_html(full_html=False, include_plotlyjs=True)
        + "<h2>Requests (ms)</h2><table border=1 cellpadding=4><tr><th>id</th><th>in</th><th>out</th><th>queue</th>"
        "<th>prefill</th><th>decode</th><th>TTFT</th><th>E2E</th><th>output</th></tr>" + rows + "</table></body></html>"
    )
    path.write_text(html, encoding="utf-8")


def _escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def run_demo(args) -> int:
    from tailguard.cli import engine_args_from
    from tailguard.engine.engine import AsyncLLMEngine

    console = Console(width=max(Console().width, 120))
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with console.status(f"loading {args.model} ..."):
        engine = AsyncLLMEngine.from_args(engine_args_from(args))
    console.print(f"engine ready: {engine.model_name} on {engine.engine.device}, weights {args.weight_format}")
    try:
        t0 = time.perf_counter()
        records = asyncio.run(_burst(engine, args.requests, args.max_tokens, console))
        wall = time.perf_counter() - t0
    finally:
        engine.shutdown()
    table = Table(title=f"{len(records)} concurrent chat requests (times in ms)")
    for col in ("id", "in", "out", "queue", "prefill", "decode", "TTFT", "E2E", "TPOT"):
        table.add_column(col, justify="left" if col == "id" else "right", no_wrap=True)
    table.add_column("output", no_wrap=True, overflow="ellipsis", max_width=36)
    for r in records:
        table.add_row(r.request_id, str(r.prompt_tokens), str(r.output_tokens), f"{r.queue_s * 1000:.0f}",
                      f"{r.prefill_s * 1000:.0f}", f"{r.decode_s * 1000:.0f}", f"{r.ttft_s * 1000:.0f}",
                      f"{r.e2e_s * 1000:.0f}", f"{r.tpot_s * 1000:.1f}", r.output[:40].replace("\n", " "))
    console.print(table)
    out_tokens = sum(r.output_tokens for r in records)
    summary = {
        "model": engine.model_name,
        "weight_format": args.weight_format,
        "device": str(engine.engine.device),
        "requests": len(records),
        "output_tokens": out_tokens,
        "wall_s": wall,
        "tokens_per_s": out_tokens / wall,
        "percentiles": {
            "TTFT": _percentiles([r.ttft_s for r in records]),
            "E2E": _percentiles([r.e2e_s for r in records]),
            "TPOT": _percentiles([r.tpot_s for r in records]),
        },
    }
    for name, p in summary["percentiles"].items():
        console.print(f"{name:5s} P50 {p['p50'] * 1000:7.0f} ms   P95 {p['p95'] * 1000:7.0f} ms   P99 {p['p99'] * 1000:7.0f} ms")
    console.print(f"{out_tokens} output tokens in {wall:.2f} s = {out_tokens / wall:.1f} tokens/s aggregate")
    (out_dir / "results.json").write_text(json.dumps({"summary": summary, "requests": [asdict(r) for r in records]},
                                                     indent=2, ensure_ascii=False))
    report = out_dir / "report.html"
    write_report(records, summary, report)
    console.print(f"[bold green]report:[/] {report.resolve()}")
    return 0
