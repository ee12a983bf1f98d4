"""``tailguard bench compare A.json B.json``: what changed from A (baseline) to B (candidate), and a CI gate.

For each latency metric and percentile: the delta B - A, a bootstrap CI of the delta (resampling requests of each
run independently; ITL by whole requests), a two-sided p-value, and whether it is significant. The gate fails when
a gated percentile (P50 by default: "no change may regress P50") rose significantly *and* by more than the minimum
effect (relative and absolute, so that a statistically real 0.1 ms drift does not break a build), or when B fails
an SLO profile it was evaluated against.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

from tailguard.bench.results import load_results, write_json
from tailguard.bench.stats import diff_test

METRICS = ("ttft", "itl", "tpot", "e2e")


@dataclass
class GateRules:
    percentiles: tuple[float, ...] = (50.0,)
    metrics: tuple[str, ...] = METRICS
    min_rel: float = 0.05
    min_abs: float = 0.001  # seconds
    slo: bool = True


def _vals(res: dict, metric: str):
    s = res.get("samples") or {}
    if metric == "itl":
        itl = s.get("itl") or {}
        return [v for v in itl.get("values") or []], itl.get("request")
    vals = [v for v in s.get(metric) or [] if v is not None]
    pf = (res.get("summary") or {}).get("percentile_failures") or {}
    if metric in ("ttft", "e2e") and pf.get("policy") == "failures_at_timeout" and pf.get("timeout_s") is not None:
        vals += [pf["timeout_s"]] * int(pf.get("failed") or 0)  # the run put its failures in the tail: so do we
    return vals, None


def _failed(res: dict) -> int:
    return int((res.get("summary") or {}).get("requests", {}).get("failed") or 0)


def compare(a: dict, b: dict, rules: GateRules | None = None, reps: int = 1000, seed: int = 0,
            percentiles=(50.0, 90.0, 95.0, 99.0)) -> dict:
    rules = rules or GateRules()
    qs = sorted(set(percentiles) | set(rules.percentiles))
    rows = []
    for metric in METRICS:
        av, ac = _vals(a, metric)
        bv, bc = _vals(b, metric)
        if len(av) < 2 or len(bv) < 2:
            continue
        for q in qs:
            d = diff_test(av, bv, q, ac, bc, reps=reps, seed=seed)
            d.update(metric=metric, percentile=q)
            gated = metric in rules.metrics and q in rules.percentiles
            big = (d["delta"] or 0) > rules.min_abs and (d["rel"] is None or d["rel"] > rules.min_rel)
            d["regression"] = bool(d["significant"] and (d["delta"] or 0) > 0 and big)
            d["improvement"] = bool(d["significant"] and (d["delta"] or 0) < 0 and -(d["delta"] or 0) > rules.min_abs
                                    and (d["rel"] is None or -d["rel"] > rules.min_rel))
            d["gated"] = gated
            rows.append(d)
    ta, tb = a["summary"]["throughput"], b["summary"]["throughput"]
    through = {}
    for k in ("requests_per_s", "output_tokens_per_s"):
        x, y = ta.get(k), tb.get(k)
        through[k] = {"a": x, "b": y, "rel": (y - x) / x if x and y is not None else None}
    ea, eb = a["summary"].get("error_rate"), b["summary"].get("error_rate")
    reasons = []
    for d in rows:
        if d["gated"] and d["regression"]:
            reasons.append(f"{d['metric'].upper()} P{d['percentile']:g} regressed {d['delta'] * 1e3:+.2f} ms "
                           f"({(d['rel'] or 0) * 100:+.1f}%, CI [{d['ci'][0] * 1e3:+.2f}, {d['ci'][1] * 1e3:+.2f}] ms, "
                           f"p={d['p_value']:.3g})")
    slo_b = {k: v.get("pass") for k, v in (b.get("slo") or {}).items() if v.get("evaluated")}
    if rules.slo:
        for name, ok in slo_b.items():
            if not ok:
                reasons.append(f"B fails the {name} SLO profile")
    return {
        "schema": "tailguard.bench.compare/v1",
        "a": {"id": a["run"]["id"], "label": a["run"].get("label"), "started_at": a["run"].get("started_at")},
        "b": {"id": b["run"]["id"], "label": b["run"].get("label"), "started_at": b["run"].get("started_at")},
        "rules": vars(rules) | {"percentiles": list(rules.percentiles), "metrics": list(rules.metrics)},
        "rows": rows,
        "throughput": through,
        "error_rate": {"a": ea, "b": eb},
        "failed": {"a": _failed(a), "b": _failed(b),
                   "policy": {"a": ((a["summary"].get("percentile_failures") or {}).get("policy") or "success_only"),
                              "b": ((b["summary"].get("percentile_failures") or {}).get("policy") or "success_only")}},
        "slo_a": {k: v.get("pass") for k, v in (a.get("slo") or {}).items()},
        "slo_b": slo_b,
        "gate": {"pass": not reasons, "reasons": reasons},
    }


def print_compare(cmp: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(title="B vs A (delta = B - A; 95% bootstrap CI)")
    for c in ("metric", "pct", "A ms", "B ms", "delta ms", "rel", "CI ms", "p", ""):
        t.add_column(c, justify="right" if c not in ("metric", "") else "left")
    for d in cmp["rows"]:
        ci = d["ci"]
        mark = "[red]regression[/]" if d["regression"] else "[green]improvement[/]" if d["improvement"] else (
            "significant" if d["significant"] else "")
        if d["gated"]:
            mark += " (gated)"
        t.add_row(d["metric"].upper(), f"P{d['percentile']:g}", f"{d['a'] * 1e3:.2f}", f"{d['b'] * 1e3:.2f}",
                  f"{d['delta'] * 1e3:+.2f}", "n/a" if d["rel"] is None else f"{d['rel'] * 100:+.1f}%",
                  "n/a" if not ci else f"[{ci[0] * 1e3:+.2f}, {ci[1] * 1e3:+.2f}]",
                  "n/a" if d["p_value"] is None else f"{d['p_value']:.3f}", mark)
    console.print(t)
    if _failed_line(cmp):
        console.print(_failed_line(cmp))
    for k, v in cmp["throughput"].items():
        if v["a"] is not None and v["b"] is not None:
            console.print(f"{k}: {v['a']:.2f} -> {v['b']:.2f} ({(v['rel'] or 0) * 100:+.1f}%)")
    g = cmp["gate"]
    if g["pass"]:
        console.print("[green bold]gate: PASS[/]")
    else:
        console.print("[red bold]gate: FAIL[/]")
        for r in g["reasons"]:
            console.print(f"  - {r}")


def _failed_line(cmp: dict) -> str:
    """How many failed requests each run leaves out; empty when neither run had any (nothing to say)."""
    f = cmp.get("failed") or {}
    if not f.get("a") and not f.get("b"):
        return ""
    parts = []
    for k in ("a", "b"):
        n = f.get(k, 0)
        at_timeout = (f.get("policy") or {}).get(k) == "failures_at_timeout"
        parts.append(f"{k.upper()} {n}" + (" (in TTFT/E2E at the timeout)" if at_timeout and n else ""))
    return "failed requests left out of these percentiles (each an SLO miss): " + ", ".join(parts)


def _run_words(r: dict) -> str:
    """'run tgb-1a2b3c4d "baseline", started 2026-01-02T03:04:05' rather than a Python dict."""
    label = f' "{r["label"]}"' if r.get("label") else ""
    started = f", started {str(r['started_at'])[:19].replace('T', ' ')} UTC" if r.get("started_at") else ""
    return f"run {r.get('id')}{label}{started}"


def write_compare_html(cmp: dict, a: dict, b: dict, path: Path) -> Path:
    import plotly.graph_objects as go
    import plotly.offline

    from tailguard.bench.report import CSS, cdf_caption, cdf_figure, sentence

    e = html.escape
    rows = []
    for d in cmp["rows"]:
        cls = "fail" if d["regression"] else "pass" if d["improvement"] else ""
        ci = d["ci"]
        rel = "n/a" if d["rel"] is None else f"{d['rel'] * 100:+.1f}%"
        ci_s = "n/a" if not ci else f"[{ci[0] * 1e3:+.2f}, {ci[1] * 1e3:+.2f}]"
        p = "n/a" if d["p_value"] is None else f"{d['p_value']:.3f}"
        mark = "regression" if d["regression"] else "improvement" if d["improvement"] else ""
        rows.append(f"<tr><td class=l>{d['metric'].upper()}</td><td>P{d['percentile']:g}</td>"
                    f"<td>{d['a'] * 1e3:.2f}</td><td>{d['b'] * 1e3:.2f}</td><td class={cls}>{d['delta'] * 1e3:+.2f}</td>"
                    f"<td>{rel}</td><td>{ci_s}</td><td>{p}</td>"
                    f"<td class={cls}>{mark}{' (gated)' if d['gated'] else ''}</td></tr>")
    fig = go.Figure()
    for metric in ("ttft", "itl", "tpot", "e2e"):
        sel = [d for d in cmp["rows"] if d["metric"] == metric and d["rel"] is not None]
        fig.add_trace(go.Bar(
            x=[f"P{d['percentile']:g}" for d in sel], y=[d["rel"] * 100 for d in sel], name=metric.upper(),
            error_y={"type": "data", "symmetric": False,
                     "array": [((d["ci"][1] - d["delta"]) / d["a"] * 100) if d["ci"] and d["a"] else 0 for d in sel],
                     "arrayminus": [((d["delta"] - d["ci"][0]) / d["a"] * 100) if d["ci"] and d["a"] else 0
                                    for d in sel]}))
    fig.update_layout(barmode="group", height=420, yaxis_title="B vs A (%)",
                      title_text="Relative change per percentile, with 95% CI")
    g = cmp["gate"]
    gate = ("<p class=pass>GATE: PASS</p>" if g["pass"] else
            "<p class=fail>GATE: FAIL</p><ul>" + "".join(f"<li>{e(r)}</li>" for r in g["reasons"]) + "</ul>")
    body = (f"<h1>tailguard bench compare</h1><p class=muted>A = {e(_run_words(cmp['a']))}<br>"
            f"B = {e(_run_words(cmp['b']))}</p>"
            + gate + "<table><tr><th class=l>metric</th><th>pct</th><th>A ms</th><th>B ms</th><th>delta ms</th>"
            "<th>rel</th><th>95% CI ms</th><th>p</th><th></th></tr>" + "".join(rows) + "</table>"
            + (f"<p class=muted>{e(sentence(_failed_line(cmp)))}</p>" if _failed_line(cmp) else "")
            + fig.to_html(full_html=False, include_plotlyjs=False, div_id="fig-compare")
            + cdf_caption([("A", a), ("B", b)])
            + cdf_figure(a, b, ("A", "B")).to_html(full_html=False, include_plotlyjs=False, div_id="fig-cdf"))
    doc = ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>tailguard bench compare</title>"
           f"<style>{CSS}</style><script>{plotly.offline.get_plotlyjs()}</script></head><body>{body}</body></html>")
    path.write_text(doc, encoding="utf-8")
    return path


def run_compare(a_path: str, b_path: str, rules: GateRules, html_path: str | None = None,
                json_path: str | None = None, reps: int = 1000, console=None) -> dict:
    a, b = load_results(a_path), load_results(b_path)
    cmp = compare(a, b, rules, reps=reps)
    print_compare(cmp, console)
    if html_path:
        write_compare_html(cmp, a, b, Path(html_path))
    if json_path:
        write_json(Path(json_path), cmp)
    return cmp
