"""``tailguard bench compare A.json B.json``: what changed from A (baseline) to B (candidate), and a CI gate.

For each latency metric and percentile: the delta B - A, a bootstrap CI of the delta (resampling requests of each
run independently; ITL by whole requests), a two-sided p-value, and whether it is significant. The gate fails when
a gated percentile (P50 by default: "no change may regress P50") rose significantly *and* by more than the minimum
effect (relative and absolute, so that a statistically real 0.1 ms drift does not break a build), or when B fails
an SLO profile it was evaluated against.

With traffic classes in both runs, the same rows and rules apply to each class as well (its requests resampled on
their own), and the gate names the class that regressed or failed its profile.
"""

from __future__ import annotations

import html
import math
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
    classes: tuple[str, ...] | None = None  # traffic classes whose rows and verdicts gate; None: every shared one

    def __post_init__(self) -> None:
        # every comparison with NaN is False: a NaN minimum would let any regression pass the gate
        for name, v in (("min_rel", self.min_rel), ("min_abs", self.min_abs)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"gate rule {name} must be a finite number >= 0, got {v!r}")


def _by_class(res: dict) -> dict:
    return ((res.get("classes") or {}).get("by_class")) or {}


def _vals(res: dict, metric: str, cls: str | None = None):
    s = res.get("samples") or {}
    if cls is not None:  # one class's values: samples.class is aligned with samples.index
        names = s.get("class") or []
        idx = s.get("index") or []
        if metric == "itl":
            mine = {i for i, c in zip(idx, names) if c == cls}
            itl = s.get("itl") or {}
            pairs = [(v, r) for v, r in zip(itl.get("values") or [], itl.get("request") or []) if r in mine]
            return [v for v, _ in pairs], [r for _, r in pairs]
        vals = [v for v, c in zip(s.get(metric) or [], names) if c == cls and v is not None]
        pf = _by_class(res).get(cls, {}).get("percentile_failures") or {}
        if metric in ("ttft", "e2e") and pf.get("policy") == "failures_at_timeout" and pf.get("timeout_s") is not None:
            vals += [pf["timeout_s"]] * int(pf.get("failed") or 0)
        return vals, None
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


def _rows(a: dict, b: dict, rules: GateRules, qs: list[float], reps: int, seed: int,
          cls: str | None = None) -> list[dict]:
    rows = []
    for metric in METRICS:
        av, ac = _vals(a, metric, cls)
        bv, bc = _vals(b, metric, cls)
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
    return rows


def _reason(d: dict) -> str:
    return (f"{d['metric'].upper()} P{d['percentile']:g} regressed {d['delta'] * 1e3:+.2f} ms "
            f"({(d['rel'] or 0) * 100:+.1f}%, CI [{d['ci'][0] * 1e3:+.2f}, {d['ci'][1] * 1e3:+.2f}] ms, "
            f"p={d['p_value']:.3g})")


def _compare_classes(a: dict, b: dict, rules: GateRules, qs: list[float], reps: int, seed: int) -> dict | None:
    """Per traffic class both runs have: the rows, each run's verdicts, and what fails the gate."""
    ca, cb = _by_class(a), _by_class(b)
    if not ca and not cb:
        return None
    shared = [n for n in cb if n in ca]
    out: dict = {"shared": shared, "only_a": [n for n in ca if n not in cb], "only_b": [n for n in cb if n not in ca],
                 "gated": [n for n in shared if rules.classes is None or n in rules.classes], "by_class": {}}
    for name in shared:
        gated = name in out["gated"]
        rows = _rows(a, b, rules, qs, reps, seed, cls=name)
        for d in rows:
            d["gated"] = d["gated"] and gated
        slo_b = {k: v.get("pass") for k, v in (cb[name].get("slo") or {}).items() if v.get("evaluated")}
        reasons = [f"class {name}: {_reason(d)}" for d in rows if d["gated"] and d["regression"]]
        if rules.slo and gated:
            reasons += [f"class {name}: B fails the {p} SLO profile" for p, ok in slo_b.items() if not ok]
        out["by_class"][name] = {
            "rows": rows,
            "requests": {"a": (ca[name].get("requests") or {}).get("measured"),
                         "b": (cb[name].get("requests") or {}).get("measured")},
            "failed": {"a": (ca[name].get("requests") or {}).get("failed"),
                       "b": (cb[name].get("requests") or {}).get("failed")},
            "slo_a": {k: v.get("pass") for k, v in (ca[name].get("slo") or {}).items()},
            "slo_b": slo_b, "gated": gated, "reasons": reasons,
        }
    return out


def compare(a: dict, b: dict, rules: GateRules | None = None, reps: int = 1000, seed: int = 0,
            percentiles=(50.0, 90.0, 95.0, 99.0)) -> dict:
    rules = rules or GateRules()
    qs = sorted(set(percentiles) | set(rules.percentiles))
    rows = _rows(a, b, rules, qs, reps, seed)
    ta, tb = a["summary"]["throughput"], b["summary"]["throughput"]
    through = {}
    for k in ("requests_per_s", "output_tokens_per_s"):
        x, y = ta.get(k), tb.get(k)
        through[k] = {"a": x, "b": y, "rel": (y - x) / x if x and y is not None else None}
    ea, eb = a["summary"].get("error_rate"), b["summary"].get("error_rate")
    reasons = [_reason(d) for d in rows if d["gated"] and d["regression"]]
    slo_b = {k: v.get("pass") for k, v in (b.get("slo") or {}).items() if v.get("evaluated")}
    if rules.slo:
        for name, ok in slo_b.items():
            if not ok:
                reasons.append(f"B fails the {name} SLO profile")
    classes = _compare_classes(a, b, rules, qs, reps, seed)
    failed_classes = []
    if classes is not None:
        for name, c in classes["by_class"].items():
            reasons += c["reasons"]
            if c["reasons"]:
                failed_classes.append(name)
    out = {
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
    if classes is not None:
        out["rules"]["classes"] = None if rules.classes is None else list(rules.classes)
        out["classes"] = classes
        out["gate"]["failed_classes"] = failed_classes
    return out


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
    if cmp.get("classes"):
        _print_classes(cmp, console)
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


def _class_rows(cmp: dict) -> list[tuple[str, dict]]:
    """(class, row) for the terminal: the gated percentiles and P99 of each metric (the JSON and HTML have all)."""
    keep = set(cmp["rules"]["percentiles"]) | {99.0}
    return [(name, d) for name, c in cmp["classes"]["by_class"].items() for d in c["rows"] if d["percentile"] in keep]


def _print_classes(cmp: dict, console) -> None:
    from rich.table import Table

    cl = cmp["classes"]
    t = Table(title="by traffic class (delta = B - A; 95% bootstrap CI)")
    for c in ("class", "metric", "pct", "A ms", "B ms", "delta ms", "rel", "CI ms", "p", ""):
        t.add_column(c, justify="right" if c not in ("class", "metric", "") else "left")
    for name, d in _class_rows(cmp):
        ci = d["ci"]
        mark = "[red]regression[/]" if d["regression"] else "[green]improvement[/]" if d["improvement"] else (
            "significant" if d["significant"] else "")
        if d["gated"]:
            mark += " (gated)"
        t.add_row(name, d["metric"].upper(), f"P{d['percentile']:g}", f"{d['a'] * 1e3:.2f}", f"{d['b'] * 1e3:.2f}",
                  f"{d['delta'] * 1e3:+.2f}", "n/a" if d["rel"] is None else f"{d['rel'] * 100:+.1f}%",
                  "n/a" if not ci else f"[{ci[0] * 1e3:+.2f}, {ci[1] * 1e3:+.2f}]",
                  "n/a" if d["p_value"] is None else f"{d['p_value']:.3f}", mark)
    console.print(t)
    for name, c in cl["by_class"].items():
        verdicts = ", ".join(f"{p} {'pass' if ok else 'FAIL'}" for p, ok in c["slo_b"].items()) or "none judged"
        console.print(f"class {name}: {c['requests']['a']} -> {c['requests']['b']} requests; B's verdicts: {verdicts}"
                      + ("" if c["gated"] else " (not gated)"))
    for key, words in (("only_a", "only in A"), ("only_b", "only in B")):
        if cl[key]:
            console.print(f"classes {words} (not compared): {', '.join(cl[key])}")


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
    class_html = _classes_html(cmp) if cmp.get("classes") else ""
    g = cmp["gate"]
    gate = ("<p class=pass>GATE: PASS</p>" if g["pass"] else
            "<p class=fail>GATE: FAIL</p><ul>" + "".join(f"<li>{e(r)}</li>" for r in g["reasons"]) + "</ul>")
    body = (f"<h1>tailguard bench compare</h1><p class=muted>A = {e(_run_words(cmp['a']))}<br>"
            f"B = {e(_run_words(cmp['b']))}</p>"
            + gate + "<table><tr><th class=l>metric</th><th>pct</th><th>A ms</th><th>B ms</th><th>delta ms</th>"
            "<th>rel</th><th>95% CI ms</th><th>p</th><th></th></tr>" + "".join(rows) + "</table>"
            + (f"<p class=muted>{e(sentence(_failed_line(cmp)))}</p>" if _failed_line(cmp) else "")
            + class_html
            + fig.to_html(full_html=False, include_plotlyjs=False, div_id="fig-compare")
            + cdf_caption([("A", a), ("B", b)])
            + cdf_figure(a, b, ("A", "B")).to_html(full_html=False, include_plotlyjs=False, div_id="fig-cdf"))
    doc = ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>tailguard bench compare</title>"
           f"<style>{CSS}</style><script>{plotly.offline.get_plotlyjs()}</script></head><body>{body}</body></html>")
    path.write_text(doc, encoding="utf-8")
    return path


def _row_html(d: dict, first: str = "") -> str:
    cls = "fail" if d["regression"] else "pass" if d["improvement"] else ""
    ci = d["ci"]
    rel = "n/a" if d["rel"] is None else f"{d['rel'] * 100:+.1f}%"
    ci_s = "n/a" if not ci else f"[{ci[0] * 1e3:+.2f}, {ci[1] * 1e3:+.2f}]"
    p = "n/a" if d["p_value"] is None else f"{d['p_value']:.3f}"
    mark = "regression" if d["regression"] else "improvement" if d["improvement"] else ""
    return (f"<tr>{first}<td class=l>{d['metric'].upper()}</td><td>P{d['percentile']:g}</td>"
            f"<td>{d['a'] * 1e3:.2f}</td><td>{d['b'] * 1e3:.2f}</td><td class={cls}>{d['delta'] * 1e3:+.2f}</td>"
            f"<td>{rel}</td><td>{ci_s}</td><td>{p}</td>"
            f"<td class={cls}>{mark}{' (gated)' if d['gated'] else ''}</td></tr>")


def _classes_html(cmp: dict) -> str:
    """Per traffic class: B's verdicts and every percentile row, the class named on each."""
    e = html.escape
    cl = cmp["classes"]
    out = ["<h2>By traffic class</h2>"]
    for name, c in cl["by_class"].items():
        verdicts = ", ".join(f"{p}: {'pass' if ok else 'FAIL'}" for p, ok in c["slo_b"].items()) or "none judged"
        state = "fail" if c["reasons"] else "pass"
        out.append(f"<h3>class {e(name)} <span class={state}>{'FAIL' if c['reasons'] else 'pass'}</span></h3>"
                   f"<p class=muted>{c['requests']['a']} requests in A, {c['requests']['b']} in B; B's verdicts: "
                   f"{e(verdicts)}{'' if c['gated'] else ' (not gated)'}</p>")
        out.append("<table><tr><th class=l>metric</th><th>pct</th><th>A ms</th><th>B ms</th><th>delta ms</th>"
                   "<th>rel</th><th>95% CI ms</th><th>p</th><th></th></tr>" + "".join(_row_html(d) for d in c["rows"])
                   + "</table>")
    for key, words in (("only_a", "only in A"), ("only_b", "only in B")):
        if cl[key]:
            out.append(f"<p class=muted>Classes {words} (not compared): {e(', '.join(cl[key]))}.</p>")
    return "".join(out)


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
