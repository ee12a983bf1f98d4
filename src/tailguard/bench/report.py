"""One self-contained HTML report (plotly.js inline, opens offline): verdicts first, then the figures that explain them.

Figures: latency CDFs with the SLO thresholds; TTFT / ITL / E2E over time beside the arrival rate; the stage
breakdown by percentile band; a Sankey diagram of where the time goes (the mean request and the slowest 1%); the
rate sweep when there was one. Tables: verdicts per SLO profile, percentiles with confidence intervals, golden-rule
advisories, the slowest requests with the stage that made each slow, tokens, tokenization cost per language (L1),
and the bench's own health.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import numpy as np

COLORS = {"tokenize": "#8c564b", "queue": "#d62728", "prefill": "#ff7f0e", "decode": "#1f77b4",
          "stream": "#17becf", "network_client": "#7f7f7f", "unsplit": "#bcbd22", "before_first_token": "#ff7f0e",
          "tail": "#17becf"}
METRIC_NAMES = {"ttft": "TTFT", "itl": "ITL", "tpot": "TPOT", "e2e": "E2E", "ttfb": "time to headers",
                "send_lag": "send lag (bench)"}

CSS = """
body{font-family:-apple-system,Segoe UI,Roboto,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1280px;
color:#222;padding:0 16px}
h1{font-size:24px;margin-bottom:4px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd;padding-bottom:4px}
table{border-collapse:collapse;margin:8px 0;font-size:13px}th,td{border:1px solid #ddd;padding:4px 8px;text-align:right}
th{background:#f5f5f5}td.l,th.l{text-align:left}.pass{color:#0a7d28;font-weight:600}.fail{color:#c00;font-weight:600}
.na{color:#888}.warn{background:#fff6e0;border-left:4px solid #f0a000;padding:6px 10px;margin:4px 0}
.info{background:#eef5ff;border-left:4px solid #4a90d9;padding:6px 10px;margin:4px 0}
.muted{color:#666;font-size:12px}.grid{display:flex;flex-wrap:wrap;gap:24px}code{background:#f3f3f3;padding:1px 4px}
"""


def _ms(x, nd: int = 1) -> str:
    return "–" if x is None else f"{x * 1e3:.{nd}f}"


def _e(s) -> str:
    return html.escape(str(s))


def _fig_html(fig, div_id: str) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id,
                       config={"displaylogo": False, "responsive": True})


def _ecdf(values, max_points: int = 2000) -> tuple[np.ndarray, np.ndarray]:
    v = np.sort(np.asarray([x for x in values if x is not None], dtype=float))
    if v.size == 0:
        return v, v
    y = np.arange(1, v.size + 1) / v.size
    if v.size > max_points:  # keep the shape: an even grid in probability, plus the whole top 1%
        body = np.unique(np.linspace(0, int(v.size * 0.99), max_points // 2).astype(int))
        tail = np.arange(int(v.size * 0.99), v.size)
        if tail.size > max_points // 2:
            tail = np.unique(np.linspace(tail[0], v.size - 1, max_points // 2).astype(int))
        idx = np.concatenate([body, tail])
        return v[idx], y[idx]
    return v, y


def _thresholds(results: dict) -> dict[str, set[float]]:
    out: dict[str, set[float]] = {}
    for v in (results.get("slo") or {}).values():
        for c in v.get("checks", []):
            if c.get("metric") in ("ttft", "itl", "tpot", "e2e") and c.get("status") != "n/a":
                out.setdefault(c["metric"], set()).add(c["threshold_s"])
    return out


def cdf_figure(results: dict, compare: dict | None = None, names=("A", "B")):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=2, cols=2, subplot_titles=[f"{METRIC_NAMES[k]} CDF" for k in ("ttft", "itl", "tpot",
                                                                                           "e2e")])
    runs = [(names[0], results)] + ([(names[1], compare)] if compare else [])
    thr = _thresholds(results)
    dashes = ["solid", "dash"]
    for j, (label, res) in enumerate(runs):
        s = res.get("samples") or {}
        for k, (r, c) in zip(("ttft", "itl", "tpot", "e2e"), ((1, 1), (1, 2), (2, 1), (2, 2))):
            vals = s.get(k, {}).get("values") if k == "itl" else s.get(k)
            x, y = _ecdf(vals or [])
            fig.add_trace(go.Scatter(x=x * 1e3, y=y, mode="lines", name=f"{label} {METRIC_NAMES[k]}",
                                     line={"dash": dashes[j % 2]}, legendgroup=label,
                                     hovertemplate="%{x:.1f} ms: %{y:.3f}<extra></extra>"), row=r, col=c)
            if j == 0:
                far = []
                top = float(x.max()) if x.size else 0.0
                for t in sorted(thr.get(k, ())):
                    # a threshold far beyond the data would squash the curve into the axis: name it instead
                    if top and t * 1e3 > 2.0 * top:
                        far.append(t)
                        continue
                    fig.add_vline(x=t * 1e3, line={"color": "#c00", "dash": "dot", "width": 1}, row=r, col=c)
                if far:
                    fig.add_annotation(text="SLO " + ", ".join(f"{t * 1e3:g}" for t in far) + " ms: off to the right",
                                       xref="x domain", yref="y domain", x=0.98, y=0.05, showarrow=False,
                                       font={"color": "#c00", "size": 11}, row=r, col=c)
            fig.update_xaxes(title_text="ms", row=r, col=c)
    fig.update_yaxes(range=[0, 1.01])
    failed = ", ".join(f"{label} {int(((res.get('summary') or {}).get('requests') or {}).get('failed') or 0)}"
                       for label, res in runs)
    fig.update_layout(height=620, margin={"t": 40, "b": 40}, showlegend=bool(compare),
                      title_text="Latency CDFs of completed requests (red dotted lines: SLO thresholds; failed "
                                 f"requests not shown: {failed})")
    return fig


def timeline_figure(results: dict):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    s = results.get("samples") or {}
    t = np.asarray(s.get("intended_s") or [], dtype=float)
    idx = np.asarray(s.get("index") or [])
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=["TTFT and E2E by send time", "ITL per request (mean and max)",
                                        "arrival and completion rate (per second)"])
    sel = np.arange(t.size)
    if t.size > 20000:
        sel = np.random.default_rng(0).choice(t.size, 20000, replace=False)
    for k, color in (("e2e", "#1f77b4"), ("ttft", "#ff7f0e")):
        v = np.asarray([x if x is not None else np.nan for x in s.get(k) or []], dtype=float)
        if v.size:
            fig.add_trace(go.Scattergl(x=t[sel], y=v[sel] * 1e3, mode="markers", name=METRIC_NAMES[k],
                                       marker={"size": 3, "color": color, "opacity": 0.6}), row=1, col=1)
    itl = s.get("itl") or {}
    vals = np.asarray(itl.get("values") or [], dtype=float)
    owner = np.asarray(itl.get("request") or [])
    if vals.size and idx.size:
        pos = {int(i): p for p, i in enumerate(idx)}
        uniq, inv = np.unique(owner, return_inverse=True)
        mean = np.bincount(inv, weights=vals) / np.bincount(inv)
        mx = np.full(uniq.size, -np.inf)
        np.maximum.at(mx, inv, vals)
        tx = np.asarray([t[pos[int(u)]] if int(u) in pos else np.nan for u in uniq])
        fig.add_trace(go.Scattergl(x=tx, y=mean * 1e3, mode="markers", name="ITL mean",
                                   marker={"size": 3, "color": "#2ca02c"}), row=2, col=1)
        fig.add_trace(go.Scattergl(x=tx, y=mx * 1e3, mode="markers", name="ITL max",
                                   marker={"size": 3, "color": "#9467bd", "opacity": 0.5}), row=2, col=1)
    if t.size:
        end = float(np.nanmax(t)) + 1
        bins = np.arange(0, end + 1, 1.0)
        failed = np.asarray(s.get("failed_intended_s") or [], dtype=float)
        arr, _ = np.histogram(np.concatenate([t, failed]), bins)
        e2e = np.asarray([x if x is not None else np.nan for x in s.get("e2e") or []], dtype=float)
        comp, _ = np.histogram(t + np.nan_to_num(e2e), bins)
        fig.add_trace(go.Bar(x=bins[:-1], y=arr, name="arrivals/s", marker={"color": "#bbb"}), row=3, col=1)
        fig.add_trace(go.Scatter(x=bins[:-1], y=comp, name="completions/s", mode="lines",
                                 line={"color": "#1f77b4"}), row=3, col=1)
        if failed.size:
            fe, _ = np.histogram(failed, bins)
            fig.add_trace(go.Scatter(x=bins[:-1], y=fe, name="failures/s", mode="lines", line={"color": "#c00"}),
                          row=3, col=1)
    fig.update_yaxes(title_text="ms", row=1, col=1)
    fig.update_yaxes(title_text="ms", row=2, col=1)
    fig.update_yaxes(title_text="req/s", row=3, col=1)
    fig.update_xaxes(title_text="seconds since start (intended send time)", row=3, col=1)
    fig.update_layout(height=760, margin={"t": 40, "b": 40}, title_text="Over time")
    return fig


def bands_figure(stages: dict):
    import plotly.graph_objects as go

    fig = go.Figure()
    bands = stages.get("bands") or []
    labels = stages.get("labels") or {}
    for k in stages.get("stages") or []:
        fig.add_trace(go.Bar(x=[f"{b['band']} (n={b['requests']})" for b in bands],
                             y=[(b["mean_s"].get(k) or 0) * 1e3 for b in bands], name=labels.get(k, k),
                             marker={"color": COLORS.get(k)}))
    fig.update_layout(barmode="stack", height=420, yaxis_title="mean ms per request",
                      title_text="Stage breakdown by E2E percentile band", margin={"t": 50, "b": 40})
    return fig


def sankey_figure(stages: dict):
    """Where the time goes: E2E -> server / network-client -> stages; the mean request and the P99 band."""
    import plotly.graph_objects as go

    names = stages.get("stages") or []
    labels = stages.get("labels") or {}
    mode = stages.get("mode")
    fig = go.Figure()
    for dom, key, title in (((0, 0.48), "mean_s", "mean request"), ((0.52, 1.0), "p99_band_mean_s",
                                                                     "slowest 1% (P99 band)")):
        vals = stages.get(key) or {}
        if mode == "server":
            nodes = ["E2E", "server", "network/client", "before first token", "generation"] + \
                    [labels[k] for k in ("tokenize", "queue", "prefill", "decode", "stream")]
            ix = {n: i for i, n in enumerate(nodes)}
            v = {k: (vals.get(k) or 0.0) * 1e3 for k in names}
            srv = sum(v[k] for k in ("tokenize", "queue", "prefill", "decode", "stream"))
            links = [("E2E", "server", srv), ("E2E", "network/client", v["network_client"]),
                     ("server", "before first token", v["tokenize"] + v["queue"] + v["prefill"]),
                     ("server", "generation", v["decode"] + v["stream"]),
                     ("before first token", labels["tokenize"], v["tokenize"]),
                     ("before first token", labels["queue"], v["queue"]),
                     ("before first token", labels["prefill"], v["prefill"]),
                     ("generation", labels["decode"], v["decode"]), ("generation", labels["stream"], v["stream"])]
            ncolor = ["#444", "#666", COLORS["network_client"], "#999", "#999"] + \
                     [COLORS[k] for k in ("tokenize", "queue", "prefill", "decode", "stream")]
        else:
            nodes = ["E2E"] + [labels.get(k, k) for k in names]
            ix = {n: i for i, n in enumerate(nodes)}
            links = [("E2E", labels.get(k, k), (vals.get(k) or 0.0) * 1e3) for k in names]
            ncolor = ["#444"] + [COLORS.get(k, "#888") for k in names]
        total = sum(x for a, _, x in links if a == "E2E") or 1.0
        nl = [f"{n}" for n in nodes]
        fig.add_trace(go.Sankey(
            domain={"x": list(dom), "y": [0, 1]}, arrangement="snap", valueformat=".1f", valuesuffix=" ms",
            node={"label": nl, "color": ncolor, "pad": 14, "thickness": 14},
            link={"source": [ix[a] for a, _, _ in links], "target": [ix[b] for _, b, _ in links],
                  "value": [max(x, 1e-6) for _, _, x in links],
                  "customdata": [f"{x / total * 100:.1f}%" for _, _, x in links],
                  "hovertemplate": "%{source.label} → %{target.label}: %{value} (%{customdata})<extra></extra>"},
            name=title))
        fig.add_annotation(x=(dom[0] + dom[1]) / 2, y=1.08, xref="paper", yref="paper", showarrow=False,
                           text=f"<b>{title}</b> ({total:.1f} ms)")
    fig.update_layout(height=460, margin={"t": 60, "b": 20}, title_text="Where the time goes (Sankey)")
    return fig


def sweep_figure(sweep: dict):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    steps = sorted(sweep.get("steps") or [], key=lambda s: s["rate"])
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    x = [s["rate"] for s in steps]
    for k, color in (("e2e_p50_s", "#1f77b4"), ("e2e_p99_s", "#d62728"), ("ttft_p99_s", "#ff7f0e")):
        fig.add_trace(go.Scatter(x=x, y=[(s.get(k) or 0) * 1e3 for s in steps], name=k.replace("_s", " (ms)"),
                                 mode="lines+markers", line={"color": color}), secondary_y=False)
    fig.add_trace(go.Scatter(x=x, y=[s.get("goodput_rps") or 0 for s in steps], name="goodput (req/s)",
                             mode="lines+markers", line={"color": "#2ca02c", "dash": "dash"}), secondary_y=True)
    if sweep.get("best_rate"):
        fig.add_vline(x=sweep["best_rate"], line={"color": "#0a7d28", "dash": "dot"})
    fig.update_xaxes(title_text="offered rate (req/s)")
    fig.update_yaxes(title_text="ms", secondary_y=False)
    fig.update_yaxes(title_text="req/s", secondary_y=True)
    fig.update_layout(height=420, title_text=f"Rate sweep against the {sweep.get('profile')} profile")
    return fig


# --- tables ---------------------------------------------------------------------------------------------------

def verdict_table(slo: dict) -> str:
    rows = []
    for name, v in slo.items():
        head = "pass" if v["pass"] else ("fail" if v["evaluated"] else "n/a")
        gp = v.get("goodput_rps")
        rows.append(f"<tr><th class=l colspan=6>{_e(name)}: <span class={head if head != 'n/a' else 'na'}>"
                    f"{head.upper()}</span> <span class=muted>{_e(v['description'])}; goodput "
                    f"{'–' if gp is None else f'{gp:.2f}'} req/s ({(v.get('goodput_ratio') or 0) * 100:.1f}% of "
                    f"requests met every bound)</span></th></tr>")
        for c in v["checks"]:
            st = c["status"]
            if "value_s" in c:
                val = _ms(c.get("value_s"))
                if c.get("value_s") is None and c.get("failed_in_scope"):
                    val = "failed"  # the percentile lands on failed requests: no latency to show
                ci = c.get("ci_s")
                ci_s = f"[{_ms(ci[0])}, {_ms(ci[1])}]" if ci else "–"
                thr = _ms(c["threshold_s"])
                unit = "ms"
            else:
                val = "–" if c.get("value") is None else f"{c['value'] * 100:.2f}%"
                ci = c.get("ci")
                ci_s = f"[{ci[0] * 100:.2f}%, {ci[1] * 100:.2f}%]" if ci and ci[0] is not None else "–"
                thr = "–" if c.get("threshold") is None else f"{c['threshold'] * 100:g}%"
                unit = ""
            cert = "" if st == "n/a" else ("" if c.get("certain", True) else " (uncertain)")
            if c.get("failed_in_scope"):
                cert += f" <span class=muted>({c['failed_in_scope']} failed counted as misses)</span>"
            rows.append(f"<tr><td class=l>{_e(c['objective'])}</td><td>{val} {unit}</td><td>{ci_s}</td>"
                        f"<td>{thr} {unit}</td><td class={st if st != 'n/a' else 'na'}>{st}{cert}</td>"
                        f"<td class='l muted'>{_e(c.get('note', ''))}</td></tr>")
    return ("<table><tr><th class=l>objective</th><th>value</th><th>95% CI</th><th>threshold</th><th>verdict</th>"
            "<th class=l>note</th></tr>" + "".join(rows) + "</table>")


def metrics_table(metrics: dict) -> str:
    qs = ("p50", "p90", "p95", "p99", "p99.9")
    head = "".join(f"<th>{q.upper()} ms [95% CI]</th>" for q in qs)
    rows = []
    for k in ("ttft", "itl", "tpot", "e2e", "ttfb", "send_lag"):
        d = metrics.get(k) or {}
        if not d.get("count"):
            continue
        cells = []
        for q in qs:
            p = (d.get("percentiles") or {}).get(q) or {}
            ci = p.get("ci")
            ci_s = f" <span class=muted>[{_ms(ci[0])}, {_ms(ci[1])}]</span>" if ci else ""
            cells.append(f"<td>{_ms(p.get('value'), 2)}{ci_s}</td>")
        excl = d.get("excluded_failures", 0)
        at_to = d.get("failures_at_timeout", 0)
        rows.append(f"<tr><td class=l>{METRIC_NAMES[k]}</td><td>{d['count']}</td><td>{_ms(d.get('mean'), 2)}</td>"
                    + "".join(cells) + f"<td>{excl}{f' ({at_to} at timeout)' if at_to else ''}</td></tr>")
    return (f"<table><tr><th class=l>metric</th><th>n</th><th>mean ms</th>{head}<th>failed excluded</th></tr>"
            f"{''.join(rows)}</table>")


def _kv_table(d: dict) -> str:
    rows = "".join(f"<tr><td class=l>{_e(k)}</td><td class=l>{_e(v)}</td></tr>" for k, v in d.items()
                   if v is not None and v != {} and v != [])
    return f"<table>{rows}</table>"


def write_report(results: dict, path: str | Path) -> Path:
    import plotly.offline

    path = Path(path)
    s = results["summary"]
    run = results["run"]
    tp = s["throughput"]
    parts = [f"<h1>tailguard bench: {_e(run['target']['model'])} at {_e(run['target']['url'])}</h1>",
             f"<div class=muted>run {_e(run['id'])} started {_e(run['started_at'])}; workload "
             f"{_e(run['workload'].get('kind'))}; load {_e(json.dumps(run['load']))}</div>"]
    parts.append("<h2>Verdicts</h2>" + verdict_table(results.get("slo") or {}))
    parts.append(
        f"<p>{s['requests']['completed']} of {s['requests']['measured']} measured requests completed "
        f"({s['requests']['warmup']} warm-up excluded) in {s['duration_s']:.2f} s: "
        f"<b>{(tp['requests_per_s'] or 0):.2f} req/s</b>, {(tp['output_tokens_per_s'] or 0):.1f} output tokens/s, "
        f"error rate {(s['error_rate'] or 0) * 100:.2f}%.</p>")
    for w in results.get("warnings") or []:
        parts.append(f"<div class=warn>{_e(w)}</div>")
    pf = s.get("percentile_failures") or {}
    failures_note = (f"<div class=warn>{_e(pf['note'])}</div>" if pf.get("failed") else
                     "<p class=muted>No request failed: every measured request is in the percentiles.</p>")
    parts.append("<h2>Latency percentiles</h2>" + metrics_table(results["metrics"]) + failures_note +
                 "<p class=muted>Measured at the client from each request's intended send time (no coordinated "
                 "omission). ITL counts every gap; a chunk of k tokens adds k-1 zero gaps. CIs: bootstrap over "
                 "requests.</p>")
    adv = [a for a in results.get("advisories") or [] if a["fired"]]
    parts.append("<h2>Golden rules</h2>")
    if not adv:
        parts.append("<div class=info>No golden rule fired (P99 <= 3 x P50 and P99 <= 1.5 x P95).</div>")
    for a in adv:
        cls = "warn" if a["severity"] == "warning" else "info"
        parts.append(f"<div class={cls}><b>{METRIC_NAMES.get(a['metric'], a['metric'])}: {a['rule']}</b> "
                     f"(ratio {a['ratio']:.2f}): {_e(a['action'])}. {_e(a['note'])}</div>")
    figs = [("fig-cdf", cdf_figure(results))]
    st = results.get("stages") or {}
    if st.get("mode") not in (None, "none"):
        figs.append(("fig-sankey", sankey_figure(st)))
        figs.append(("fig-bands", bands_figure(st)))
    figs.append(("fig-timeline", timeline_figure(results)))
    if results.get("sweep"):
        figs.insert(0, ("fig-sweep", sweep_figure(results["sweep"])))
    parts.append("<h2>Figures</h2>")
    for div_id, fig in figs:
        parts.append(_fig_html(fig, div_id))
    if st.get("mode") not in (None, "none"):
        share = st.get("share_of_e2e") or {}
        labels = st.get("labels") or {}
        rows = "".join(f"<tr><td class=l>{_e(labels.get(k, k))}</td><td>{_ms(st['mean_s'][k], 2)}</td>"
                       f"<td>{share.get(k, 0) * 100:.1f}%</td><td>{_ms(st['p99_band_mean_s'][k], 2)}</td></tr>"
                       for k in st["stages"])
        parts.append(f"<h2>Stages</h2><p>Source: {_e(st['mode'])} ({_e(json.dumps(st['sources']))}). "
                     f"{_e(st['note'])}.</p><table><tr><th class=l>stage</th><th>mean ms</th><th>share</th>"
                     f"<th>P99 band mean ms</th></tr>{rows}</table>")
        if st.get("over_20_percent"):
            parts.append("<div class=info>Stages holding more than 20% of latency (attack these first, M2): "
                         + _e(", ".join(labels.get(k, k) for k in st["over_20_percent"])) + "</div>")
        for c in st.get("cannot_split") or []:
            parts.append(f"<div class=warn>Cannot split: {_e(c)}</div>")
    te = results.get("timing_error")
    if te:
        parts.append("<h2>Client vs server timestamps</h2>" + _kv_table({
            "requests compared": te["requests"],
            "TTFT client - server, P50 / P99 (ms)": f"{_ms(te['ttft_client_minus_server_s']['p50'], 3)} / "
                                                    f"{_ms(te['ttft_client_minus_server_s']['p99'], 3)}",
            "ITL |client - server|, P50 / P99 (ms)": f"{_ms(te['itl_abs_error_s']['p50'], 3)} / "
                                                     f"{_ms(te['itl_abs_error_s']['p99'], 3)}"}))
    sl = results.get("slowest") or []
    if sl:
        rows = "".join(
            f"<tr><td class=l>{_e(r['request_id'])}</td><td>{_ms(r['e2e_s'])}</td><td>{_ms(r['ttft_s'])}</td>"
            f"<td>{r['prompt_tokens'] or '–'}</td><td>{r['output_tokens'] or '–'}</td><td class=l>{_e(r['lang'])}</td>"
            f"<td class=l><b>{_e(r['slow_stage'] or '–')}</b></td><td class='l muted'>"
            f"{_e(', '.join(f'{k} {v * 1e3:.1f}' for k, v in (r['stages_s'] or {}).items()))}</td></tr>"
            for r in sl)
        parts.append("<h2>Slowest requests</h2><table><tr><th class=l>request</th><th>E2E ms</th><th>TTFT ms</th>"
                     "<th>prompt tok</th><th>output tok</th><th class=l>lang</th><th class=l>slow stage</th>"
                     f"<th class=l>stages (ms)</th></tr>{rows}</table><p class=muted>The slow stage is the one "
                     "furthest above its own median.</p>")
    bl = results.get("by_language") or {}
    tc = (results.get("tokenization_cost") or {}).get("by_language") or {}
    if bl:
        rows = []
        for lang, d in bl.items():
            c = tc.get(lang, {})
            rows.append(f"<tr><td class=l>{_e(lang)}</td><td>{d['requests']}</td>"
                        f"<td>{d.get('failed_excluded', 0)}</td><td>{_ms(d['ttft_p50_s'])}</td>"
                        f"<td>{_ms(d['ttft_p99_s'])}</td><td>{_ms(d['e2e_p99_s'])}</td>"
                        f"<td>{(d.get('prompt_tokens_mean') or 0):.0f}</td>"
                        f"<td>{c.get('encode_us_per_request_p50', 0):.1f}</td>"
                        f"<td>{c.get('tokens_per_char', 0):.2f}</td>"
                        f"<td>{c.get('per_char_cost_vs_en', float('nan')):.2f}</td>"
                        f"<td>{_ms(d.get('server_tokenize_p50_s'), 3)}</td></tr>")
        parts.append("<h2>By language and tokenization cost (L1)</h2><table><tr><th class=l>lang</th><th>n</th>"
                     "<th>failed excluded</th>"
                     "<th>TTFT P50 ms</th><th>TTFT P99 ms</th><th>E2E P99 ms</th><th>prompt tokens</th>"
                     "<th>local encode µs/prompt</th><th>tokens/char</th><th>cost per char vs en</th>"
                     "<th>server tokenize P50 ms</th></tr>" + "".join(rows) + "</table><p class=muted>"
                     + _e((results.get("tokenization_cost") or {}).get("note", "")) + "</p>")
    tok = results.get("tokens") or {}
    parts.append("<h2>Tokens</h2>" + _kv_table({
        "output tokens from": json.dumps(tok.get("output_tokens_source")),
        "chunks (multi-token)": json.dumps(tok.get("chunks")),
        "recount vs usage drift": json.dumps(tok.get("recount_vs_usage_drift")),
        "prompt tokens": json.dumps(tok.get("prompt_tokens")),
        "fixed output lengths": json.dumps(tok.get("fixed_output")),
    }))
    parts.append("<h2>Bench health</h2>" + _kv_table({k: json.dumps(v) if isinstance(v, dict) else v
                                                      for k, v in (results.get("bench_health") or {}).items()}))
    wl = run.get("workload") or {}
    parts.append("<h2>Run</h2>" + _kv_table({"workload": json.dumps(wl), "load": json.dumps(run.get("load")),
                                             "capabilities": json.dumps(run.get("capabilities")),
                                             "join": json.dumps(run.get("join")), "seed": run.get("seed"),
                                             "command": run.get("command")}))
    if wl.get("attribution"):
        parts.append(f"<p class=muted>Trace: {_e(wl['attribution'])}.</p>")
    doc = ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>tailguard bench report</title>"
           f"<style>{CSS}</style><script type='text/javascript'>{plotly.offline.get_plotlyjs()}</script></head>"
           "<body>" + "\n".join(parts) + "</body></html>")
    path.write_text(doc, encoding="utf-8")
    return path
