"""The report of ``tailguard bench ab``: one HTML page (plotly.js inline, opens offline) and the terminal summary.

Verdicts and the change against the baseline come first; then each arm's percentiles with their confidence intervals
(pooled over the repeats) and the run-to-run spread, the traffic classes, the highest rate that meets the SLO, where
the time went (the arms' Sankey diagrams side by side), the cost in replica-seconds, and the runs in the order they
ran. Every figure of an arm is beside the baseline's, and every ratio is arm / baseline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tailguard.bench.report import (
    CSS,
    METRIC_NAMES,
    NA,
    SUBPLOT_TOP_MARGIN,
    _details,
    _e,
    _fig_html,
    _nb,
    _title,
    describe_load,
    describe_workload,
    fmt_ci,
    fmt_int,
    fmt_pct,
    fmt_rate,
    fmt_s,
    sankey_trace,
    sentence,
    sig,
    verdict_table,
)

ARM_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
METRICS = ("ttft", "itl", "tpot", "e2e")
PCTS = (("p50", "P50"), ("p95", "P95"), ("p99", "P99"))
LOWER_IS_BETTER = ("ttft", "itl", "tpot", "e2e", "error_rate", "cost")


def _pc(metrics: dict, k: str, q: str) -> dict:
    return ((((metrics or {}).get(k) or {}).get("percentiles")) or {}).get(q) or {}


def figure_label(key: str) -> str:
    """``ttft.p99`` -> 'TTFT P99'; ``goodput.strict`` -> 'goodput, strict profile (req/s)'."""
    head, _, tail = key.partition(".")
    if head in METRICS:
        return f"{METRIC_NAMES[head]} {tail.upper()}"
    return {
        "throughput.requests_per_s": "throughput (completed req/s)",
        "throughput.output_tokens_per_s": "output tokens/s",
        "error_rate": "error rate",
        "cost.replica_seconds": "replica-seconds",
        "cost.replica_seconds_per_1000_requests": "replica-seconds per 1,000 requests",
        "capacity.best_scale": "highest passing time scale",
        "capacity.best_offered_rps": "highest passing offered rate (req/s)",
    }.get(key, f"goodput, {tail} profile (req/s)" if head == "goodput" else key)


def _fmt_figure(key: str, v: float | None) -> str:
    head = key.partition(".")[0]
    if v is None:
        return NA
    if head in METRICS:
        return fmt_s(v)
    if key == "error_rate":
        return fmt_pct(v)
    return sig(v)


def _better(key: str, ratio: float | None) -> str | None:
    """'better', 'worse' or None (no change to speak of: within 1%)."""
    if ratio is None or abs(ratio - 1) < 0.01:
        return None
    lower = key.partition(".")[0] in LOWER_IS_BETTER
    return "better" if (ratio < 1) == lower else "worse"


def _ratio_text(r: float | None) -> str:
    return NA if r is None else f"{sig(r)}×"


def _arms(results: dict) -> list[str]:
    return list(results.get("arms") or {})


def _color(i: int) -> str:
    return ARM_COLORS[i % len(ARM_COLORS)]


# --- figures --------------------------------------------------------------------------------------------------

def percentile_figure(results: dict):
    """Per arm, TTFT/ITL/TPOT/E2E at P50/P95/P99 (pooled over its repeats), each bar with its 95% CI."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=4, subplot_titles=[METRIC_NAMES[k] for k in METRICS], horizontal_spacing=0.06)
    for i, name in enumerate(_arms(results)):
        metrics = results["arms"][name]["pooled"]["metrics"]
        for col, k in enumerate(METRICS, 1):
            vals, hi, lo = [], [], []
            for q, _ in PCTS:
                p = _pc(metrics, k, q)
                v, ci = p.get("value"), p.get("ci") or [None, None]
                vals.append(None if v is None else v * 1e3)
                hi.append(0 if v is None or ci[1] is None else (ci[1] - v) * 1e3)
                lo.append(0 if v is None or ci[0] is None else (v - ci[0]) * 1e3)
            fig.add_trace(go.Bar(x=[label for _, label in PCTS], y=vals, name=name, legendgroup=name,
                                 showlegend=col == 1, marker={"color": _color(i)},
                                 error_y={"type": "data", "symmetric": False, "array": hi, "arrayminus": lo},
                                 hovertemplate=f"{name} %{{x}}: %{{y:.1f}} ms<extra></extra>"), row=1, col=col)
            fig.update_yaxes(title_text="ms" if col == 1 else None, row=1, col=col)
    fig.update_layout(barmode="group", height=440, margin={"t": SUBPLOT_TOP_MARGIN, "b": 40},
                      title=_title("Percentiles per arm, pooled over its repeats (with 95% CI)"))
    return fig


def class_figure(results: dict):
    """P99 of TTFT and E2E per traffic class, one bar per arm, with 95% CIs."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    names = _arms(results)
    first = ((results["arms"][names[0]]["pooled"].get("classes") or {}).get("by_class")) or {}
    classes = list(first)
    fig = make_subplots(rows=1, cols=3, subplot_titles=["TTFT P99", "ITL P99", "E2E P99"], horizontal_spacing=0.07)
    for i, name in enumerate(names):
        by = ((results["arms"][name]["pooled"].get("classes") or {}).get("by_class")) or {}
        for col, k in enumerate(("ttft", "itl", "e2e"), 1):
            vals, hi, lo = [], [], []
            for c in classes:
                p = _pc((by.get(c) or {}).get("metrics") or {}, k, "p99")
                v, ci = p.get("value"), p.get("ci") or [None, None]
                vals.append(None if v is None else v * 1e3)
                hi.append(0 if v is None or ci[1] is None else (ci[1] - v) * 1e3)
                lo.append(0 if v is None or ci[0] is None else (v - ci[0]) * 1e3)
            fig.add_trace(go.Bar(x=classes, y=vals, name=name, legendgroup=name, showlegend=col == 1,
                                 marker={"color": _color(i)},
                                 error_y={"type": "data", "symmetric": False, "array": hi, "arrayminus": lo}),
                          row=1, col=col)
        fig.update_yaxes(title_text="ms", row=1, col=1)
    fig.update_layout(barmode="group", height=420, margin={"t": SUBPLOT_TOP_MARGIN, "b": 40},
                      title=_title("P99 per traffic class and arm (with 95% CI)"))
    return fig


def sankey_arms_figure(results: dict, key: str, heading: str):
    """One Sankey diagram per arm, side by side: where the time of its requests went (``key``: mean_s or
    p99_band_mean_s)."""
    import plotly.graph_objects as go

    arms = [(n, results["arms"][n]["pooled"].get("stages") or {}) for n in _arms(results)]
    arms = [(n, st) for n, st in arms if st.get("mode") not in (None, "none")]
    fig = go.Figure()
    k = max(1, len(arms))
    gap = 0.04
    for i, (name, st) in enumerate(arms):
        dom = (i / k + (gap / 2 if i else 0), (i + 1) / k - (gap / 2 if i < k - 1 else 0))
        trace, total = sankey_trace(st, key, dom, name)
        fig.add_trace(trace)
        n = st.get("requests") if key == "mean_s" else st.get("p99_band_requests")
        count = "" if n is None else f", n = {n:,}"
        fig.add_annotation(x=dom[0], y=1.02, xref="paper", yref="paper", showarrow=False, xanchor="left",
                           yanchor="bottom", align="left",
                           text=f"<b>{_e(name)}</b> ({_e(st.get('mode'))} split)<br>{fmt_s(total / 1e3)}{count}")
    fig.update_layout(height=480, margin={"t": SUBPLOT_TOP_MARGIN, "b": 20}, title=_title(heading))
    return fig


def capacity_figure(results: dict):
    """E2E P99 against the offered rate at each swept time scale, per arm; a cross where the SLO failed."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for i, name in enumerate(_arms(results)):
        rows = results["arms"][name]["capacity"]["scales"]
        x = [r["offered_rps"] if r.get("offered_rps") is not None else r["scale"] for r in rows]
        fig.add_trace(go.Scatter(
            x=x, y=[None if r["e2e_p99_s"] is None else r["e2e_p99_s"] * 1e3 for r in rows], name=name,
            mode="lines+markers", line={"color": _color(i)},
            marker={"size": 11, "symbol": ["circle" if r["pass"] else "x" for r in rows]},
            customdata=[f"time scale {r['scale']:g}: {'meets the SLO' if r['pass'] else 'fails the SLO'}"
                        for r in rows],
            hovertemplate="%{customdata}<br>%{x:.3g} req/s: E2E P99 %{y:.1f} ms<extra>" + name + "</extra>"))
    fig.update_xaxes(title_text="offered rate (req/s)")
    fig.update_yaxes(title_text="E2E P99 (ms)")
    fig.update_layout(height=420, margin={"t": 60},
                      title=_title("E2E P99 by offered rate (circle: meets the SLO, cross: fails)"))
    return fig


# --- tables ---------------------------------------------------------------------------------------------------

def _verdict_cell(v: dict | None) -> str:
    if not v or not v.get("evaluated"):
        return "<span class=na>n/a</span>"
    head = "pass" if v["pass"] else "fail"
    return (f"<span class={head}>{head.upper()}</span> <span class=muted>({_nb(fmt_rate(v.get('goodput_rps')))}"
            "&nbsp;good)</span>")


def verdicts_section(results: dict) -> str:
    arms = results["arms"]
    names = _arms(results)
    profiles = list(results["run"].get("profiles") or [])
    head = "".join(f"<th>{_e(p)}</th>" for p in profiles)
    rows = []
    for name in names:
        a = arms[name]
        slo = a["pooled"].get("slo") or {}
        v = a["verdict"]
        overall = ("<span class=na>n/a</span>" if v.get("pass") is None else
                   "<span class=pass>PASS</span>" if v["pass"] else
                   f"<span class=fail>FAIL</span> <span class=muted>({_e(', '.join(v['failed']))})</span>")
        cap = a["capacity"]
        cap_s = (NA if not cap["swept"] else
                 f"time scale {sig(cap['best_scale'])} ({fmt_rate(cap['best_offered_rps'])})"
                 if cap.get("best_scale") is not None else "none passed")
        base = " <span class=muted>(baseline)</span>" if name == results["baseline"] else ""
        rows.append(f"<tr><td class=l><b>{_e(name)}</b>{base}</td><td class=l>{overall}</td>"
                    + "".join(f"<td>{_verdict_cell(slo.get(p))}</td>" for p in profiles)
                    + f"<td>{_nb(cap_s) if cap['swept'] else 'not swept'}</td>"
                    f"<td>{_nb(sig(a['cost']['replica_seconds']))}</td></tr>")
    out = ("<table><tr><th class=l>arm</th><th class=l>verdict (every profile and class)</th>" + head
           + "<th>highest passing rate</th><th>replica-seconds</th></tr>" + "".join(rows) + "</table>")
    g = results.get("gate")
    if g:
        if g["pass"]:
            out += (f"<div class=info><b class=pass>GATE: PASS</b>: no arm regressed against {_e(g['baseline'])} by "
                    "the rules of <code>bench compare --gate</code>.</div>")
        else:
            reasons = "".join(f"<li>{_e(r)}</li>" for a in g["by_arm"].values() for r in a["reasons"])
            out += f"<div class=warn><b class=fail>GATE: FAIL</b> against {_e(g['baseline'])}<ul>{reasons}</ul></div>"
    return out


def ratio_section(results: dict) -> str:
    rat = results.get("ratios") or {}
    if not rat:
        return ""
    base = results["baseline"]
    others = list(rat)
    head = "".join(f"<th>{_e(n)}</th><th>{_e(n)} / {_e(base)}</th>" for n in others)
    keys = list(next(iter(rat.values()))["figures"])
    rows = []
    for key in keys:
        b = rat[others[0]]["figures"][key]["baseline"]
        cells = []
        for n in others:
            row = rat[n]["figures"].get(key) or {}
            better = _better(key, row.get("ratio"))
            cls = {"better": "pass", "worse": "fail"}.get(better or "", "")
            overlap = (" <span class=muted title='the two arms&#39; per-run ranges overlap: the difference lies "
                       "within the run-to-run spread'>(within spread)</span>" if row.get("spread_overlap") else "")
            cells.append(f"<td>{_nb(_fmt_figure(key, row.get('arm')))}</td>"
                         f"<td class={cls or 'x'}>{_nb(_ratio_text(row.get('ratio')))}{overlap}</td>")
        rows.append(f"<tr><td class=l>{_e(figure_label(key))}</td><td>{_nb(_fmt_figure(key, b))}</td>"
                    + "".join(cells) + "</tr>")
    return (f"<table><tr><th class=l>figure</th><th>{_e(base)} (baseline)</th>{head}</tr>" + "".join(rows)
            + "</table><p class=muted>Each ratio is the arm's figure divided by the baseline's: below 1 is faster "
            "for latencies and cost, above 1 is more for throughput, goodput and capacity. Green is better, red "
            "worse. \"Within spread\": the two arms' per-run values of that percentile overlap, so run-to-run noise "
            "alone could explain the difference.</p>")


def percentile_table(results: dict) -> str:
    head = "".join(f"<th>{label} [95% CI]</th>" for _, label in PCTS)
    rows = []
    for name in _arms(results):
        a = results["arms"][name]
        metrics = a["pooled"]["metrics"]
        for k in METRICS:
            d = metrics.get(k) or {}
            if not d.get("count"):
                continue
            cells = []
            for q, _ in PCTS:
                p = _pc(metrics, k, q)
                ci = p.get("ci")
                ci_s = f" <span class=muted>{_nb(fmt_ci(ci, p.get('value')))}</span>" if ci else ""
                cells.append(f"<td>{_nb(fmt_s(p.get('value')))}{ci_s}</td>")
            sp = (a["spread"].get(k) or {}).get("p99") or {}
            runs = ", ".join(fmt_s(v) for v in sp.get("values") or [])
            rng = f"{fmt_s(sp.get('min'))} – {fmt_s(sp.get('max'))}"
            rows.append(f"<tr><td class=l>{_e(name)}</td><td class=l>{METRIC_NAMES[k]}</td><td>{d['count']:,}</td>"
                        + "".join(cells) + f"<td>{_nb(rng)} <span class=muted>({_e(runs)})</span></td>"
                        f"<td>{fmt_int(d.get('excluded_failures', 0))}</td></tr>")
    return ("<table><tr><th class=l>arm</th><th class=l>metric</th><th>n (pooled)</th>" + head
            + "<th>P99 per run: min – max (each run)</th><th>failed excluded</th></tr>" + "".join(rows) + "</table>"
            + "<p class=muted>Pooled: the requests of all an arm's repeats together; CIs are bootstrap intervals "
            "over those requests (ITL resamples whole requests). The per-run column is the run-to-run spread: each "
            "repeat's own P99.</p>")


def class_section(results: dict) -> str:
    names = _arms(results)
    first = ((results["arms"][names[0]]["pooled"].get("classes") or {}).get("by_class")) or {}
    if not first:
        return ""
    head = "".join(f"<th>{METRIC_NAMES[k]} {label}</th>" for k in ("ttft", "itl", "e2e") for _, label in PCTS)
    rows = []
    for cname in first:
        for name in names:
            d = (((results["arms"][name]["pooled"].get("classes") or {}).get("by_class")) or {}).get(cname) or {}
            r = d.get("requests") or {}
            cells = "".join(f"<td>{_nb(fmt_s(_pc(d.get('metrics') or {}, k, q).get('value')))}</td>"
                            for k in ("ttft", "itl", "e2e") for q, _ in PCTS)
            verdicts = "<br>".join(f"{_e(p)} {_verdict_cell(v)}" for p, v in (d.get("slo") or {}).items()) or NA
            ratio = ""
            if name != results["baseline"]:
                row = ((results["ratios"].get(name) or {}).get("classes") or {}).get(cname, {}).get("e2e.p99") or {}
                ratio = _ratio_text(row.get("ratio"))
            sp = (((results["arms"][name].get("class_spread") or {}).get(cname) or {}).get("e2e") or {}).get("p99") \
                or {}
            per_run = f"{fmt_s(sp.get('min'))} – {fmt_s(sp.get('max'))}" if sp else NA
            rows.append(f"<tr><td class=l><b>{_e(cname)}</b></td><td class=l>{_e(name)}</td>"
                        f"<td>{fmt_pct(d.get('share_sent'))}</td><td>{fmt_int(r.get('measured'))}</td>"
                        f"<td>{fmt_int(r.get('failed'))}</td>{cells}<td>{_nb(per_run)}</td>"
                        f"<td>{_nb(ratio) or '—'}</td><td class=l>{verdicts}</td></tr>")
    return ("<table><tr><th class=l>class</th><th class=l>arm</th><th>share</th><th>n</th><th>failed</th>" + head
            + f"<th>E2E P99 per run (min – max)</th><th>E2E P99 / {_e(results['baseline'])}</th>"
            "<th class=l>verdicts (goodput)</th></tr>"
            + "".join(rows) + "</table><p class=muted>Every arm was sent the same class for the same arrival (a "
            "class follows the arrival's index and the random seed, --seed). Each class is judged by its own "
            "profiles.</p>" + _fig_html(class_figure(results), "fig-ab-classes"))


def capacity_section(results: dict) -> str:
    names = _arms(results)
    swept = any(results["arms"][n]["capacity"]["swept"] for n in names)
    if not swept:
        return ("<p>Not swept: each arm ran at one time scale "
                f"({sig(results['run'].get('main_scale') or 1)}). Give <code>--sweep-scales 1,2,4</code> for the "
                "highest time scale (and offered rate) at which each arm meets the SLO.</p>")
    rows = []
    for name in names:
        cap = results["arms"][name]["capacity"]
        for r in cap["scales"]:
            mark = ("<span class=pass>meets</span>" if r["pass"] else
                    "<span class=na>n/a</span>" if r["pass"] is None else
                    f"<span class=fail>fails</span> <span class=muted>({_e(', '.join(r['failed']))})</span>")
            best = " <b>(highest passing)</b>" if r["scale"] == cap.get("best_scale") else ""
            rows.append(f"<tr><td class=l>{_e(name)}</td><td>{sig(r['scale'])}{' (main)' if r['main'] else ''}</td>"
                        f"<td>{_nb(fmt_rate(r.get('offered_rps')))}</td><td>{fmt_int(r['runs'])}</td>"
                        f"<td>{_nb(fmt_s(r.get('ttft_p99_s')))}</td><td>{_nb(fmt_s(r.get('e2e_p99_s')))}</td>"
                        f"<td>{fmt_pct(r.get('error_rate'))}</td><td class=l>{mark}{best}</td></tr>")
    judged = results["arms"][names[0]]["capacity"]["judged_by"]
    return ("<table><tr><th class=l>arm</th><th>time scale</th><th>offered</th><th>runs</th><th>TTFT P99</th>"
            "<th>E2E P99</th><th>error rate</th><th class=l>SLO</th></tr>" + "".join(rows) + "</table>"
            + f"<p class=muted>A scale passes when the arm's runs at it, pooled, meet {_e(judged)}.</p>"
            + _fig_html(capacity_figure(results), "fig-ab-capacity"))


def stages_section(results: dict) -> str:
    names = [n for n in _arms(results) if (results["arms"][n]["pooled"].get("stages") or {}).get("mode")
             not in (None, "none")]
    if not names:
        return "<p class=muted>No arm's time could be split into stages.</p>"
    out = [_fig_html(sankey_arms_figure(results, "mean_s", "Where the time goes: the mean request"), "fig-ab-sankey"),
           _fig_html(sankey_arms_figure(results, "p99_band_mean_s", "Where the time goes: the slowest 1% (P99 band)"),
                     "fig-ab-sankey-tail")]
    order: list[str] = []
    labels: dict[str, str] = {}
    for n in names:
        st = results["arms"][n]["pooled"]["stages"]
        for k in st.get("stages") or []:
            if k not in order:
                order.append(k)
            labels.setdefault(k, (st.get("labels") or {}).get(k, k))
    head = "".join(f"<th>{_e(n)} mean</th><th>share</th><th>P99 band</th>" for n in names)
    rows = []
    for k in order:
        cells = []
        for n in names:
            st = results["arms"][n]["pooled"]["stages"]
            if k not in (st.get("stages") or []):
                cells.append("<td>—</td><td>—</td><td>—</td>")
                continue
            cells.append(f"<td>{_nb(fmt_s((st.get('mean_s') or {}).get(k)))}</td>"
                         f"<td>{fmt_pct((st.get('share_of_e2e') or {}).get(k))}</td>"
                         f"<td>{_nb(fmt_s((st.get('p99_band_mean_s') or {}).get(k)))}</td>")
        rows.append(f"<tr><td class=l>{_e(labels[k])}</td>" + "".join(cells) + "</tr>")
    out.append(f"<table><tr><th class=l>stage</th>{head}</tr>" + "".join(rows) + "</table>")
    return "".join(out)


def cost_section(results: dict) -> str:
    rows = []
    for name in _arms(results):
        c = results["arms"][name]["cost"]
        per_run = ", ".join(sig(r["cost"]["replica_seconds"]) for r in results["arms"][name]["repeats"])
        rows.append(f"<tr><td class=l>{_e(name)}</td><td>{_nb(sig(c['replica_seconds']))}</td>"
                    f"<td>{_nb(fmt_s(c['wall_s']))}</td><td>{fmt_int(c['replicas_declared'])}</td>"
                    f"<td>{_nb(sig(c['per_1000_requests'])) if c.get('per_1000_requests') is not None else NA}</td>"
                    f"<td class=l>{_e(', '.join(c['sources']))}</td><td class=l>{_e(per_run)}</td></tr>")
    return ("<table><tr><th class=l>arm</th><th>replica-seconds</th><th>wall time</th><th>declared replicas</th>"
            "<th>per 1,000 completed requests</th><th class=l>source</th><th class=l>per run</th></tr>"
            + "".join(rows) + "</table><p class=muted>Replica-seconds over each run's load and stage join (the main "
            "time scale's runs): a tailguard gateway's own counter (tailguard_gateway_replica_seconds_total, read "
            "before and after each run) when the arm exports it, else the declared replicas (--replicas) times the "
            "run's wall time.</p>")


def _exit_words(code: int | None) -> str:
    """-15 -> 'ended by SIGTERM'; 0 -> 'exit status 0'."""
    import signal

    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"ended by {signal.Signals(-code).name}"
        except ValueError:
            return f"ended by signal {-code}"
    return f"exit status {code}"


def runs_section(results: dict) -> str:
    rows = []
    recs = sorted((r for a in results["arms"].values() for r in a["repeats"] + a["other_scales"]),
                  key=lambda r: r["position"])
    for r in recs:
        pc = r["percentiles"]
        proc = r.get("process")
        started = (f"healthy after {fmt_s(proc.get('ready_s'))}, stopped by {_e(proc.get('stopped_by'))} "
                   f"({_e(_exit_words(proc.get('exit_status')))}); <a href='{_e(proc.get('log'))}'>log</a>"
                   if proc else "running already (URL)")
        rows.append(f"<tr><td>{r['position']}</td><td class=l>{_e(r['arm'])}</td><td>{r['repeat']}</td>"
                    f"<td>{sig(r['scale'])}</td><td>{fmt_int(r['requests']['measured'])}</td>"
                    f"<td>{fmt_int(r['requests']['failed'])}</td><td>{_nb(fmt_s(pc['ttft']['p99']))}</td>"
                    f"<td>{_nb(fmt_s(pc['e2e']['p50']))}</td><td>{_nb(fmt_s(pc['e2e']['p99']))}</td>"
                    f"<td>{_nb(fmt_s(r['wall_s']))}</td><td>{_nb(sig(r['cost']['replica_seconds']))}</td>"
                    f"<td><code>{_e(r['schedule']['fingerprint'])}</code></td><td class='l muted'>{started}</td>"
                    f"<td class=l><a href='{_e(r['results'])}'>results.json</a></td></tr>")
    sch = results.get("schedule") or {}
    same = ("<div class=info>Every run at each time scale sent the identical schedule (the same fingerprint).</div>"
            if sch.get("identical") else
            "<div class=warn>The runs did not all send the identical schedule: see the fingerprints.</div>")
    return (same + "<table><tr><th>#</th><th class=l>arm</th><th>repeat</th><th>time scale</th><th>n</th>"
            "<th>failed</th><th>TTFT P99</th><th>E2E P50</th><th>E2E P99</th><th>wall time</th>"
            "<th>replica-seconds</th><th>schedule</th><th class=l>server</th><th class=l>files</th></tr>"
            + "".join(rows) + "</table><p class=muted>" + _e(sentence(sch.get("note") or "")) + "</p>")


def write_ab_report(results: dict, path: str | Path) -> Path:
    import plotly.offline

    path = Path(path)
    run = results["run"]
    names = _arms(results)
    wl = run.get("workload") or {}
    load = run.get("load") or {}
    scale = load.get("time_scale")
    window = f", window {load['window']}" if load.get("window") else ""
    offered = f", offered {fmt_rate(load['offered_rps'])}" if load.get("offered_rps") else ""
    parts = [f"<h1>tailguard bench ab: {_e(' vs '.join(names))}</h1>",
             f"<div class=muted>A/B run {_e(run['id'])}{' “' + _e(run['label']) + '”' if run.get('label') else ''}, "
             f"started {_e(str(run.get('started_at'))[:19].replace('T', ' '))} UTC. Workload: "
             f"{_e(describe_workload(wl))}. Load: {_e(describe_load(load))}{_e(window)}, time scale "
             f"{_e(sig(scale or 1))}{_e(offered)}. {run.get('repeats')} repeats per arm in {_e(run.get('order_pattern'))} "
             f"order ({_e(' '.join(o['arm'] for o in results['order'] if o['main']))}); baseline "
             f"{_e(results['baseline'])}.</div>"]
    parts.append("<h2>Verdicts</h2>" + verdicts_section(results))
    for w in results.get("warnings") or []:
        parts.append(f"<div class=warn>{_e(sentence(w))}</div>")
    if results.get("ratios"):
        parts.append(f"<h2>Change against {_e(results['baseline'])}</h2>" + ratio_section(results))
    parts.append("<h2>Latency percentiles</h2>" + _fig_html(percentile_figure(results), "fig-ab-percentiles")
                 + percentile_table(results))
    classes = class_section(results)
    if classes:
        parts.append("<h2>Traffic classes</h2>" + classes)
    parts.append("<h2>Highest rate that meets the SLO</h2>" + capacity_section(results))
    parts.append("<h2>Where the time went</h2>" + stages_section(results))
    parts.append("<h2>Cost</h2>" + cost_section(results))
    parts.append("<h2>Runs, in the order they ran</h2>" + runs_section(results))
    details = []
    for name in names:
        slo = results["arms"][name]["pooled"].get("slo") or {}
        if slo:
            details.append(f"<details><summary>SLO checks of {_e(name)} (pooled)</summary>{verdict_table(slo)}"
                           "</details>")
    if details:
        parts.append("<h2>SLO checks per arm</h2>" + "".join(details))
    targets = "".join(f"<tr><td class=l>{_e(n)}</td><td class=l>{_e(results['arms'][n]['target'].get('kind'))}</td>"
                      f"<td class=l><code>{_e(results['arms'][n]['target'].get('url') or results['arms'][n]['target'].get('command'))}</code></td>"  # noqa: E501
                      f"<td class=l>{_e(results['arms'][n].get('model'))}</td></tr>" for n in names)
    parts.append("<h2>Run</h2><table><tr><th class=l>arm</th><th class=l>kind</th><th class=l>target</th>"
                 f"<th class=l>model</th></tr>{targets}</table>"
                 + (f"<p>Command: <code>{_e(run.get('command'))}</code></p>" if run.get("command") else "")
                 + _details("Raw run configuration (JSON)", {k: run.get(k) for k in ("workload", "load", "options",
                                                                                   "scales", "profiles")}))
    if wl.get("attribution"):
        parts.append(f"<p class=muted>Trace: {_e(wl['attribution'])}.</p>")
    doc = ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>tailguard bench ab report</title>"
           f"<style>{CSS}</style><script type='text/javascript'>{plotly.offline.get_plotlyjs()}</script></head>"
           "<body>" + "\n".join(parts) + "</body></html>")
    path.write_text(doc, encoding="utf-8")
    return path


# --- the terminal summary -------------------------------------------------------------------------------------

def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1e3:.1f}"


def _verdict_words(profile: str, v: dict) -> str:
    mark = ("[green]PASS[/]" if v["pass"] else "[red]FAIL[/]") if v.get("evaluated") else "[dim]n/a[/]"
    gp = v.get("goodput_rps")
    return f"{profile} {mark} ({'n/a' if gp is None else f'{gp:.2f}'})"


def _cell(key: str, arm: dict, value: float | None) -> str:
    """An arm's figure for the terminal: a pooled percentile with its 95% CI, else ``value`` (from the ratios)."""
    head, _, q = key.partition(".")
    if head not in METRICS:
        return _fmt_figure(key, value)
    p = _pc(arm["pooled"]["metrics"], head, q)
    ci = p.get("ci")
    return _ms(p.get("value")) + (f" [{_ms(ci[0])}–{_ms(ci[1])}]" if ci else "")


TERMINAL_FIGURES = ("ttft.p50", "ttft.p99", "itl.p50", "itl.p99", "tpot.p50", "e2e.p50", "e2e.p99")


def print_ab_summary(results: dict, console: Any = None) -> None:
    from rich.table import Table

    if console is None:
        from rich.console import Console

        console = Console(highlight=False)
    run = results["run"]
    names = _arms(results)
    base = results["baseline"]
    others = [n for n in names if n != base]
    rat = results.get("ratios") or {}
    order = " ".join(o["arm"] for o in results["order"] if o["main"])
    reps = run.get("repeats") or 0
    t = Table(title=f"tailguard bench ab {run['id']}: {len(names)} arms, {reps} repeat{'s' if reps != 1 else ''} each "
                    f"({order}); ms, pooled [95% CI]")
    t.add_column("figure", justify="left")
    t.add_column(f"{base} (baseline)", justify="right")
    for n in others:
        t.add_column(n, justify="right")
        t.add_column(f"/ {base}", justify="right")
    rows_of = {n: (rat.get(n) or {}).get("figures") or {} for n in others}
    every = next(iter(rows_of.values()), {})
    keys = list(TERMINAL_FIGURES) + [k for k in every
                                     if k.partition(".")[0] not in METRICS and not k.startswith("throughput.output")]
    for key in keys:
        cells = [_cell(key, results["arms"][base], (every.get(key) or {}).get("baseline"))]
        for n in others:
            row = rows_of[n].get(key) or {}
            text = _ratio_text(row.get("ratio")) + (" ~" if row.get("spread_overlap") else "")
            color = {"better": "green", "worse": "red"}.get(_better(key, row.get("ratio")) or "")
            cells += [_cell(key, results["arms"][n], row.get("arm")), f"[{color}]{text}[/]" if color else text]
        t.add_row(figure_label(key), *cells)
        if key == "e2e.p99":  # the run-to-run spread, right under the pooled figure
            spread = [results["arms"][n]["spread"]["e2e"]["p99"] for n in [base, *others]]
            row_cells = [f"{_ms(sp['min'])}–{_ms(sp['max'])}" for sp in spread]
            t.add_row("E2E P99 per run (min–max)", row_cells[0], *[x for c in row_cells[1:] for x in (c, "")])
    console.print(t)
    console.print("[dim]ratio = arm / baseline; green better, red worse; ~: the arms' per-run values of that "
                  "percentile overlap (a difference within the run-to-run spread)[/]")
    v = Table(title="SLO verdicts, pooled (goodput req/s)")
    for c in ("arm", "requests", "failed", "verdicts", "highest passing"):
        v.add_column(c, justify="right" if c in ("requests", "failed") else "left")
    for name in names:
        a = results["arms"][name]
        req = a["pooled"]["summary"]["requests"]
        verdicts = ", ".join(_verdict_words(p, x) for p, x in (a["pooled"].get("slo") or {}).items())
        cap = a["capacity"]
        best = ("not swept" if not cap["swept"] else "none" if cap.get("best_scale") is None else
                f"time scale {cap['best_scale']:g}" + (f" ({cap['best_offered_rps']:.3g} req/s)"
                                                       if cap.get("best_offered_rps") else ""))
        v.add_row(name, str(req["measured"]), str(req["failed"]), verdicts or "none judged", best)
    console.print(v)
    first = ((results["arms"][names[0]]["pooled"].get("classes") or {}).get("by_class")) or {}
    if first:
        c = Table(title="traffic classes (pooled)")
        for col in ("class", "arm", "n", "TTFT P50/P95/P99 ms", "E2E P50/P95/P99 ms", "verdicts"):
            c.add_column(col, justify="left" if col in ("class", "arm", "verdicts") else "right")
        for cname in first:
            for name in names:
                d = (((results["arms"][name]["pooled"].get("classes") or {}).get("by_class")) or {}).get(cname) or {}
                m = d.get("metrics") or {}
                verdicts = ", ".join(f"{p} {'pass' if v['pass'] else 'FAIL'}" for p, v in (d.get("slo") or {}).items()
                                     if v.get("evaluated")) or "none judged"
                c.add_row(cname, name, str((d.get("requests") or {}).get("measured", 0)),
                          "/".join(_ms(_pc(m, "ttft", q).get("value")) for q, _ in PCTS),
                          "/".join(_ms(_pc(m, "e2e", q).get("value")) for q, _ in PCTS), verdicts)
        console.print(c)
    sch = results.get("schedule") or {}
    console.print("every arm was sent the identical schedule" if sch.get("identical") else
                  "[yellow]the arms were not all sent the identical schedule (see the warnings)[/]")
    g = results.get("gate")
    if g:
        if g["pass"]:
            console.print(f"[green bold]gate: PASS[/] (every arm against {g['baseline']})")
        else:
            console.print(f"[red bold]gate: FAIL[/] (against {g['baseline']})")
            for a in g["by_arm"].values():
                for reason in a["reasons"]:
                    console.print(f"  - {reason}")
    for w in results.get("warnings") or []:
        console.print(f"[yellow]warning[/] {sentence(w)}")
