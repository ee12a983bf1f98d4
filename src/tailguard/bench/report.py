"""One self-contained HTML report (plotly.js inline, opens offline): verdicts first, then the figures that explain them.

Figures: latency CDFs with the SLO thresholds; TTFT / ITL / E2E over time beside the arrival rate; the stage
breakdown by percentile band; a Sankey diagram of where the time goes (the mean request and the slowest 1%); the
rate sweep when there was one. Tables: verdicts per SLO profile, percentiles with confidence intervals, golden-rule
advisories, the slowest requests with the stage that made each slow, tokens, tokenization cost per language, and
the bench's own health.

Written for a person reading it at a glance: every number carries its unit and 3 significant figures, every
percentile its sample size (and a warning where the sample is too small for it), missing values read "n/a", and the
raw JSON of the run sits in collapsed <details> blocks only.
"""

from __future__ import annotations

import html
import json
import math
from datetime import datetime
from pathlib import Path

import numpy as np

from tailguard.bench.profiles import plain_words
from tailguard.bench.stats import SAMPLE_RULE, enough_samples, min_samples

COLORS = {"tokenize": "#8c564b", "queue": "#d62728", "prefill": "#ff7f0e", "decode": "#1f77b4",
          "stream": "#17becf", "network_client": "#7f7f7f", "unsplit": "#bcbd22", "before_first_token": "#ff7f0e",
          "tail": "#17becf"}
METRIC_NAMES = {"ttft": "TTFT", "itl": "ITL", "tpot": "TPOT", "e2e": "E2E", "ttfb": "time to headers",
                "send_lag": "send lag (bench)"}
CDF_METRICS = ("ttft", "itl", "tpot", "e2e")
NA = "n/a"
DOT_SIZE = 6  # px: 3 px dots vanish on a laptop screen
SUBPLOT_TOP_MARGIN = 100  # px above the plots: the figure's title, then the subplot titles, without overlap
# A threshold further right than this multiple of the data's largest value would squash the curve into the axis.
FAR_THRESHOLD = 2.0

CSS = """
body{font-family:-apple-system,Segoe UI,Roboto,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1280px;
color:#222;padding:0 16px}
h1{font-size:24px;margin-bottom:4px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd;padding-bottom:4px}
table{border-collapse:collapse;margin:8px 0;font-size:13px}th,td{border:1px solid #ddd;padding:4px 8px;text-align:right}
th{background:#f5f5f5}td.l,th.l{text-align:left}.pass{color:#0a7d28;font-weight:600}.fail{color:#c00;font-weight:600}
.na{color:#888}.warn{background:#fff6e0;border-left:4px solid #f0a000;padding:6px 10px;margin:4px 0}
.info{background:#eef5ff;border-left:4px solid #4a90d9;padding:6px 10px;margin:4px 0}
.few{color:#b36b00}.muted{color:#666;font-size:12px}.grid{display:flex;flex-wrap:wrap;gap:24px}
code{background:#f3f3f3;padding:1px 4px}details{margin:8px 0}summary{cursor:pointer;color:#444}
pre{background:#f7f7f7;padding:8px;font-size:12px;overflow-x:auto;max-height:480px}
"""


# --- numbers for people ---------------------------------------------------------------------------------------

def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and not math.isfinite(x))


def sig(x: float, digits: int = 3) -> str:
    """At most ``digits`` significant figures, no exponent, no trailing zeros: 1040.69 -> '1,041',
    0.04871 -> '0.0487', 1.2 -> '1.2', 2.0 -> '2'."""
    if x == 0:
        return "0"
    if abs(x) >= 10 ** digits:
        return f"{x:,.0f}"
    decimals = max(digits - 1 - math.floor(math.log10(abs(x))), 0)
    text = f"{x:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _unit(seconds: float) -> tuple[float, str]:
    a = abs(seconds)
    if 0 < a < 1e-3:
        return 1e6, "µs"
    return (1e3, "ms") if a < 1 else (1.0, "s")


def fmt_s(x: float | None) -> str:
    """A duration in seconds for people: 0.90836 -> '908 ms', 13.7079 -> '13.7 s', None -> 'n/a'."""
    if _missing(x):
        return NA
    scale, unit = _unit(x)
    return f"{sig(x * scale)} {unit}"


def fmt_ci(ci, like: float | None = None) -> str:
    """A CI in the unit of the value it belongs to: '[885, 942] ms'."""
    if not ci or _missing(ci[0]) or _missing(ci[1]):
        return NA
    scale, unit = _unit(like if not _missing(like) else ci[1])
    return f"[{sig(ci[0] * scale)}, {sig(ci[1] * scale)}] {unit}"


def fmt_pct(x: float | None) -> str:
    return NA if _missing(x) else f"{sig(x * 100)}%"


def _signed_pct(x: float | None) -> str:
    return NA if _missing(x) else ("+" if x > 0 else "") + fmt_pct(x)


def fmt_rate(x: float | None, unit: str = "req/s") -> str:
    return NA if _missing(x) else f"{sig(x)} {unit}"


def fmt_int(x) -> str:
    return NA if _missing(x) else f"{int(x):,}"


def _nb(text: str) -> str:
    """A formatted number that never breaks across lines in a table cell ('908&nbsp;ms'); cells still wrap
    between a value and its CI."""
    return text.replace(" ", "&nbsp;")


def _e(s) -> str:
    return html.escape(str(s))


def sentence(text: str) -> str:
    """A warning or note as a sentence: capital first letter, a full stop at the end, insider words replaced."""
    text = plain_words(str(text)).strip()
    if not text:
        return text
    text = text[0].upper() + text[1:]
    return text if text[-1] in ".!?" else text + "."


def _details(summary: str, obj) -> str:
    """Raw JSON for whoever needs it, collapsed so that nobody else has to read it."""
    return (f"<details><summary>{_e(summary)}</summary><pre>{_e(json.dumps(obj, indent=2, ensure_ascii=False))}"
            "</pre></details>")


def _few_mark(n: int | None, q: float) -> str:
    """A visible flag on a percentile resting on too few samples for it (the rule: ``SAMPLE_RULE``)."""
    if n is None or enough_samples(n, q):
        return ""
    return (f" <span class=few title='only {n} samples: P{q:g} needs at least {min_samples(q)}'>"
            f"⚠&nbsp;needs&nbsp;n&nbsp;≥&nbsp;{min_samples(q):,}</span>")


def _fig_html(fig, div_id: str) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id,
                       config={"displaylogo": False, "responsive": True})


def _title(text: str) -> dict:
    """A figure title pinned to the very top, clear of the subplot titles below it."""
    return {"text": text, "x": 0.01, "xanchor": "left", "yref": "container", "y": 0.99, "yanchor": "top"}


# --- figures --------------------------------------------------------------------------------------------------

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
            if c.get("metric") in CDF_METRICS and c.get("status") != "n/a":
                out.setdefault(c["metric"], set()).add(c["threshold_s"])
    return out


def _cdf_values(res: dict, metric: str) -> list:
    s = res.get("samples") or {}
    vals = (s.get(metric) or {}).get("values") if metric == "itl" else s.get(metric)
    return vals or []


def split_thresholds(thresholds, data_max_s: float) -> tuple[list[float], list[float]]:
    """(drawn, named): thresholds (seconds) on the axis, and those so far right of the data (seconds) that drawing
    them would squash the curve, which are named in a note instead. Both sides in seconds: the units must match."""
    drawn, far = [], []
    for t in sorted(thresholds):
        (far if data_max_s > 0 and t > FAR_THRESHOLD * data_max_s else drawn).append(t)
    return drawn, far


def _failed_count(res: dict) -> int:
    return int(((res.get("summary") or {}).get("requests") or {}).get("failed") or 0)


def cdf_caption(runs: list[tuple[str, dict]]) -> str:
    """What the CDFs leave out, said beside them; nothing about failures when there are none."""
    text = ("Each curve is the share of completed requests (ITL: of gaps between tokens) at or below a latency; "
            "n is its sample size. Red dotted lines: the SLO thresholds of the judged profiles.")
    failed = [(label, _failed_count(res)) for label, res in runs]
    if any(n for _, n in failed):
        if len(runs) == 1:
            text += f" {failed[0][1]} failed requests are not in the curves."
        else:
            text += " Failed requests not in the curves: " + ", ".join(f"{label} {n}" for label, n in failed) + "."
    return f"<p class=muted>{_e(text)}</p>"


def cdf_figure(results: dict, compare: dict | None = None, names=("A", "B")):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    runs = [(names[0], results)] + ([(names[1], compare)] if compare else [])
    titles = []
    for k in CDF_METRICS:
        counts = [sum(1 for x in _cdf_values(res, k) if x is not None) for _, res in runs]
        n = (f"n = {counts[0]:,}" if len(runs) == 1 else
             ", ".join(f"{label}: n = {c:,}" for (label, _), c in zip(runs, counts)))
        titles.append(f"{METRIC_NAMES[k]} ({n})")
    fig = make_subplots(rows=2, cols=2, subplot_titles=titles, vertical_spacing=0.16)
    thr = _thresholds(results)
    dashes = ["solid", "dash"]
    for j, (label, res) in enumerate(runs):
        for k, (r, c) in zip(CDF_METRICS, ((1, 1), (1, 2), (2, 1), (2, 2))):
            x, y = _ecdf(_cdf_values(res, k))
            fig.add_trace(go.Scatter(x=x * 1e3, y=y, mode="lines", name=f"{label} {METRIC_NAMES[k]}",
                                     line={"dash": dashes[j % 2]}, legendgroup=label,
                                     hovertemplate="%{x:.1f} ms: %{y:.3f}<extra></extra>"), row=r, col=c)
            if j == 0:
                drawn, far = split_thresholds(thr.get(k, ()), float(x.max()) if x.size else 0.0)
                for i, t in enumerate(drawn):
                    # labelled inside the plot, staggered, so that labels clear the subplot title and each other
                    fig.add_vline(x=t * 1e3, line={"color": "#c00", "dash": "dot", "width": 1.5}, row=r, col=c,
                                  annotation_text=f"SLO {fmt_s(t)}", annotation_position="top left",
                                  annotation_yanchor="top", annotation_y=0.97 - 0.09 * (i % 4),
                                  annotation_font={"color": "#c00", "size": 10})
                if far:
                    fig.add_annotation(text=f"SLO {', '.join(fmt_s(t) for t in far)}: far right of the data "
                                            f"(largest {fmt_s(float(x.max()))})",
                                       xref="x domain", yref="y domain", x=0.98, y=0.05, showarrow=False,
                                       xanchor="right", font={"color": "#c00", "size": 11}, row=r, col=c)
            fig.update_xaxes(title_text="ms", row=r, col=c)
    fig.update_yaxes(range=[0, 1.01])
    fig.update_layout(height=680, margin={"t": SUBPLOT_TOP_MARGIN, "b": 40}, showlegend=bool(compare),
                      title=_title("Latency CDFs of completed requests"))
    return fig


def timeline_figure(results: dict):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    s = results.get("samples") or {}
    t = np.asarray(s.get("intended_s") or [], dtype=float)
    idx = np.asarray(s.get("index") or [])
    itl = s.get("itl") or {}
    owners = len(set(itl.get("request") or []))
    failed = np.asarray(s.get("failed_intended_s") or [], dtype=float)
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=[f"TTFT and E2E by send time (n = {t.size:,} requests)",
                                        f"ITL per request, mean and max (n = {owners:,} requests)",
                                        f"Arrivals and completions per second (n = {t.size + failed.size:,} "
                                        "requests)"])
    sel = np.arange(t.size)
    if t.size > 20000:
        sel = np.random.default_rng(0).choice(t.size, 20000, replace=False)
    for k, color in (("e2e", "#1f77b4"), ("ttft", "#ff7f0e")):
        v = np.asarray([x if x is not None else np.nan for x in s.get(k) or []], dtype=float)
        if v.size:
            fig.add_trace(go.Scattergl(x=t[sel], y=v[sel] * 1e3, mode="markers", name=METRIC_NAMES[k],
                                       marker={"size": DOT_SIZE, "color": color, "opacity": 0.6}), row=1, col=1)
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
                                   marker={"size": DOT_SIZE, "color": "#2ca02c"}), row=2, col=1)
        fig.add_trace(go.Scattergl(x=tx, y=mx * 1e3, mode="markers", name="ITL max",
                                   marker={"size": DOT_SIZE, "color": "#9467bd", "opacity": 0.5}), row=2, col=1)
    if t.size:
        end = float(np.nanmax(t)) + 1
        bins = np.arange(0, end + 1, 1.0)
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
    fig.update_layout(height=800, margin={"t": SUBPLOT_TOP_MARGIN, "b": 40}, title=_title("Over time"))
    return fig


def bands_figure(stages: dict):
    import plotly.graph_objects as go

    fig = go.Figure()
    bands = stages.get("bands") or []
    labels = stages.get("labels") or {}
    for k in stages.get("stages") or []:
        fig.add_trace(go.Bar(x=[f"{b['band']} (n = {b['requests']})" for b in bands],
                             y=[(b["mean_s"].get(k) or 0) * 1e3 for b in bands], name=labels.get(k, k),
                             marker={"color": COLORS.get(k)}))
    fig.update_layout(barmode="stack", height=440, yaxis_title="mean ms per request",
                      title=_title("Stage breakdown by E2E percentile band"), margin={"t": 60, "b": 40})
    return fig


def sankey_parts(stages: dict, key: str) -> tuple[list[str], list[str], list[tuple[str, str, float]]]:
    """(node labels, node colours, links (from, to, ms)) of one Sankey panel: ``key`` is ``mean_s`` (the mean
    request) or ``p99_band_mean_s`` (the slowest 1%)."""
    names = stages.get("stages") or []
    labels = stages.get("labels") or {}
    vals = stages.get(key) or {}
    if stages.get("mode") == "server":
        nodes = ["E2E", "server", "network/client", "before first token", "generation"] + \
                [labels[k] for k in ("tokenize", "queue", "prefill", "decode", "stream")]
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
        links = [("E2E", labels.get(k, k), (vals.get(k) or 0.0) * 1e3) for k in names]
        ncolor = ["#444"] + [COLORS.get(k, "#888") for k in names]
    return nodes, ncolor, links


def sankey_trace(stages: dict, key: str, dom: tuple[float, float], title: str):
    """One Sankey panel in the horizontal band ``dom`` of its figure, and its total in ms."""
    import plotly.graph_objects as go

    nodes, ncolor, links = sankey_parts(stages, key)
    ix = {n: i for i, n in enumerate(nodes)}
    total = sum(x for a, _, x in links if a == "E2E") or 1.0
    trace = go.Sankey(
        domain={"x": list(dom), "y": [0, 1]}, arrangement="snap", valueformat=".3r", valuesuffix=" ms",
        node={"label": list(nodes), "color": ncolor, "pad": 14, "thickness": 14},
        link={"source": [ix[a] for a, _, _ in links], "target": [ix[b] for _, b, _ in links],
              "value": [max(x, 1e-6) for _, _, x in links],
              "customdata": [f"{sig(x / total * 100)}%" for _, _, x in links],
              "hovertemplate": "%{source.label} → %{target.label}: %{value} (%{customdata})<extra></extra>"},
        name=title)
    return trace, total


def sankey_figure(stages: dict):
    """Where the time goes: E2E -> server / network-client -> stages; the mean request and the P99 band."""
    import plotly.graph_objects as go

    n_all = stages.get("requests")
    n_tail = stages.get("p99_band_requests")
    fig = go.Figure()
    panels = (((0, 0.48), "mean_s", "mean request", n_all),
              ((0.52, 1.0), "p99_band_mean_s", "slowest 1% (P99 band)", n_tail))
    for dom, key, title, n in panels:
        trace, total = sankey_trace(stages, key, dom, title)
        fig.add_trace(trace)
        count = "" if n is None else f", n = {n:,} request{'s' if n != 1 else ''}"
        # each heading starts at its own panel's left edge, on two lines: long headings never run into each other
        fig.add_annotation(x=dom[0], y=1.02, xref="paper", yref="paper", showarrow=False, xanchor="left",
                           yanchor="bottom", align="left", text=f"<b>{title}</b><br>{fmt_s(total / 1e3)}{count}")
    fig.update_layout(height=500, margin={"t": SUBPLOT_TOP_MARGIN, "b": 20}, title=_title("Where the time goes"))
    return fig


def sweep_figure(sweep: dict):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    steps = sorted(sweep.get("steps") or [], key=lambda s: s["rate"])
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    x = [s["rate"] for s in steps]
    for k, label, color in (("e2e_p50_s", "E2E P50 (ms)", "#1f77b4"), ("e2e_p99_s", "E2E P99 (ms)", "#d62728"),
                            ("ttft_p99_s", "TTFT P99 (ms)", "#ff7f0e")):
        fig.add_trace(go.Scatter(x=x, y=[None if s.get(k) is None else s[k] * 1e3 for s in steps], name=label,
                                 mode="lines+markers", line={"color": color}), secondary_y=False)
    fig.add_trace(go.Scatter(x=x, y=[s.get("goodput_rps") for s in steps], name="goodput (req/s)",
                             mode="lines+markers", line={"color": "#2ca02c", "dash": "dash"}), secondary_y=True)
    if sweep.get("best_rate"):
        fig.add_vline(x=sweep["best_rate"], line={"color": "#0a7d28", "dash": "dot"})
    fig.update_xaxes(title_text="offered rate (req/s)")
    fig.update_yaxes(title_text="ms", secondary_y=False)
    fig.update_yaxes(title_text="req/s", secondary_y=True)
    fig.update_layout(height=440, margin={"t": 60}, title=_title(f"Rate sweep against the {sweep.get('profile')} "
                                                                  "profile"))
    return fig


CLASS_FIGURE_METRICS = ("ttft", "itl", "e2e")
CLASS_PERCENTILES = (("p50", "P50"), ("p95", "P95"), ("p99", "P99"))


def class_figure(results: dict):
    """TTFT, ITL and E2E at P50/P95/P99 per traffic class and for all requests, with each bar's 95% CI."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    by_class = (results.get("classes") or {}).get("by_class") or {}
    groups = [(name, d.get("metrics") or {}, (d.get("requests") or {}).get("completed")) for name, d in
              by_class.items()]
    groups.append(("all", results.get("metrics") or {}, ((results.get("summary") or {}).get("requests") or {})
                   .get("completed")))
    x = [f"{name} (n = {fmt_int(n)})" for name, _, n in groups]
    fig = make_subplots(rows=1, cols=3, subplot_titles=[METRIC_NAMES[k] for k in CLASS_FIGURE_METRICS],
                        horizontal_spacing=0.07)
    colors = {"p50": "#1f77b4", "p95": "#ff7f0e", "p99": "#d62728"}
    for col, k in enumerate(CLASS_FIGURE_METRICS, 1):
        for key, label in CLASS_PERCENTILES:
            vals, hi, lo = [], [], []
            for _, metrics, _ in groups:
                p = (((metrics.get(k) or {}).get("percentiles")) or {}).get(key) or {}
                v = p.get("value")
                ci = p.get("ci") or [None, None]
                vals.append(None if v is None else v * 1e3)
                hi.append(0 if v is None or ci[1] is None else (ci[1] - v) * 1e3)
                lo.append(0 if v is None or ci[0] is None else (v - ci[0]) * 1e3)
            fig.add_trace(go.Bar(x=x, y=vals, name=label, legendgroup=label, showlegend=col == 1,
                                 marker={"color": colors[key]},
                                 error_y={"type": "data", "symmetric": False, "array": hi, "arrayminus": lo},
                                 hovertemplate="%{x}: %{y:.1f} ms<extra>" + label + "</extra>"), row=1, col=col)
        fig.update_yaxes(title_text="ms", row=1, col=col)
    fig.update_layout(barmode="group", height=460, margin={"t": SUBPLOT_TOP_MARGIN, "b": 40},
                      title=_title("Percentiles by traffic class (with 95% CI)"))
    return fig


def class_section(results: dict) -> str:
    """The traffic classes: shares, sample sizes, percentiles, goodput and verdicts per class and for the whole."""
    cl = results.get("classes") or {}
    by_class = cl.get("by_class") or {}
    if not by_class:
        return ""
    head = "".join(f"<th>{METRIC_NAMES[k]} {label}</th>" for k in CLASS_FIGURE_METRICS
                   for _, label in CLASS_PERCENTILES)

    def cells(metrics: dict, n: int | None) -> str:
        out = []
        for k in CLASS_FIGURE_METRICS:
            for key, _ in CLASS_PERCENTILES:
                p = (((metrics.get(k) or {}).get("percentiles")) or {}).get(key) or {}
                few = _few_mark((metrics.get(k) or {}).get("count") if k == "itl" else n, float(key[1:]))
                out.append(f"<td>{_nb(fmt_s(p.get('value')))}{few}</td>")
        return "".join(out)

    def verdicts(slo: dict) -> str:
        parts = []
        for name, v in slo.items():
            head_ = "pass" if v.get("pass") else ("fail" if v.get("evaluated") else "na")
            gp = fmt_rate(v.get("goodput_rps"))
            parts.append(f"{_e(name)} <span class={head_}>{'n/a' if head_ == 'na' else head_.upper()}</span> "
                         f"<span class=muted>(goodput {_nb(gp)})</span>")
        return "<br>".join(parts) or NA

    rows = []
    for name, d in by_class.items():
        r = d.get("requests") or {}
        planned = d.get("share_planned")
        share = fmt_pct(d.get("share_sent")) + (f" <span class=muted>(planned {fmt_pct(planned)})</span>"
                                                if planned is not None else "")
        rows.append(f"<tr><td class=l><b>{_e(name)}</b></td><td>{share}</td><td>{fmt_int(r.get('measured'))}</td>"
                    f"<td>{fmt_int(r.get('failed'))}</td>{cells(d.get('metrics') or {}, r.get('completed'))}"
                    f"<td class=l>{verdicts(d.get('slo') or {})}</td></tr>")
    req = (results.get("summary") or {}).get("requests") or {}
    rows.append(f"<tr><td class=l><b>all</b></td><td>100%</td><td>{fmt_int(req.get('measured'))}</td>"
                f"<td>{fmt_int(req.get('failed'))}</td>{cells(results.get('metrics') or {}, req.get('completed'))}"
                f"<td class=l>{verdicts(results.get('slo') or {})}</td></tr>")
    how = (f"Each request's class is the trace's {_e(cl.get('column'))} column." if cl.get("assignment") == "column"
           else "Each arrival's class is drawn from its index and the random seed (--seed), with the classes' "
                "shares as probabilities, so runs of one schedule send the same class to the same arrival.")
    defs = []
    for c in cl.get("definitions") or []:
        wl = ", ".join(f"{k.replace('_', ' ')} {v if not isinstance(v, list) else '+'.join(v)}"
                       for k, v in (c.get("workload") or {}).items())
        profiles = ", ".join(c.get("profiles") or []) or "the run's profiles"
        key = "yes" if c.get("key") else "no (the run's)"
        wl = wl or "the run's workload"
        defs.append(f"<tr><td class=l>{_e(c['name'])}</td><td>{fmt_pct(c.get('share'))}</td>"
                    f"<td class=l>{_e(profiles)}</td><td class=l>{_e(key)}</td>"
                    f"<td class=l>{_e(wl)}</td></tr>")
    out = ("<table><tr><th class=l>class</th><th>share sent</th><th>n</th><th>failed</th>" + head
           + "<th class=l>verdicts (goodput)</th></tr>" + "".join(rows) + "</table>"
           + f"<p class=muted>{how} Percentiles are of each class's completed requests; failed ones are counted "
           "beside them and are SLO misses. Each class is judged by its own profiles, the whole by the run's.</p>"
           + _fig_html(class_figure(results), "fig-classes")
           + "<table><tr><th class=l>class</th><th>share</th><th class=l>SLO profiles</th><th class=l>own API key</th>"
           "<th class=l>workload</th></tr>" + "".join(defs) + "</table>")
    for name, d in by_class.items():
        if d.get("slo"):
            out += f"<h3>Verdicts of class {_e(name)}</h3>" + verdict_table(d["slo"])
    return out


# --- tables ---------------------------------------------------------------------------------------------------

def _check_n(c: dict) -> int | None:
    n = c.get("samples", c.get("requests"))
    return None if n is None else int(n)


def verdict_table(slo: dict) -> str:
    rows = []
    for name, v in slo.items():
        head = "pass" if v["pass"] else ("fail" if v["evaluated"] else "n/a")
        about = v.get("about") or plain_words(v.get("description", ""))
        unjudged = v.get("not_judged_described") or v.get("not_judged") or []
        extra = f" Not judged by the bench: {'; '.join(unjudged)}." if unjudged else ""
        rows.append(f"<tr><th class=l colspan=7>{_e(name)}: <span class={head if head != 'n/a' else 'na'}>"
                    f"{head.upper()}</span> <span class=muted>{_e(sentence(about))}{_e(extra)} Goodput "
                    f"{fmt_rate(v.get('goodput_rps'))} ({fmt_pct(v.get('goodput_ratio'))} of requests met every "
                    "bound).</span></th></tr>")
        for c in v["checks"]:
            st = c["status"]
            n = _check_n(c)
            few = ""
            if "value_s" in c:
                val = fmt_s(c.get("value_s"))
                if c.get("value_s") is None and c.get("failed_in_scope"):
                    val = "failed"  # the percentile lands on failed requests: no latency to show
                ci_s = fmt_ci(c.get("ci_s"), c.get("value_s"))
                thr = fmt_s(c["threshold_s"])
                if st != "n/a" and c.get("percentile") is not None:
                    few = _few_mark(n, float(c["percentile"]))
            else:
                val = fmt_pct(c.get("value"))
                ci = c.get("ci")
                ci_s = f"[{fmt_pct(ci[0])}, {fmt_pct(ci[1])}]" if ci and not _missing(ci[0]) else NA
                thr = fmt_pct(c.get("threshold"))
            cert = "" if st == "n/a" else ("" if c.get("certain", True) else " (uncertain)")
            if c.get("failed_in_scope"):
                cert += f" <span class=muted>({c['failed_in_scope']} failed counted as misses)</span>"
            note = sentence(c["note"]) if c.get("note") else ""
            rows.append(f"<tr><td class=l>{_e(c['objective'])}</td><td>{fmt_int(n)}</td><td>{_nb(val)}{few}</td>"
                        f"<td>{_nb(ci_s)}</td><td>{_nb(thr)}</td><td class={st if st != 'n/a' else 'na'}>{st}{cert}</td>"
                        f"<td class='l muted'>{_e(note)}</td></tr>")
    return ("<table><tr><th class=l>objective</th><th>n</th><th>value</th><th>95% CI</th><th>threshold</th>"
            "<th>verdict</th><th class=l>note</th></tr>" + "".join(rows) + "</table>")


PERCENTILE_KEYS = (("p50", 50.0), ("p90", 90.0), ("p95", 95.0), ("p99", 99.0), ("p99.9", 99.9))


def metrics_table(metrics: dict) -> str:
    head = "".join(f"<th>{k.upper()} [95% CI]</th>" for k, _ in PERCENTILE_KEYS)
    rows = []
    short: dict[str, int] = {}
    for k in ("ttft", "itl", "tpot", "e2e", "ttfb", "send_lag"):
        d = metrics.get(k) or {}
        n = d.get("count")
        if not n:
            continue
        cells = []
        for key, q in PERCENTILE_KEYS:
            p = (d.get("percentiles") or {}).get(key) or {}
            ci = p.get("ci")
            ci_s = f" <span class=muted>{_nb(fmt_ci(ci, p.get('value')))}</span>" if ci else ""
            few = _few_mark(n, q)
            if few:
                short[key] = min_samples(q)
            cells.append(f"<td>{_nb(fmt_s(p.get('value')))}{ci_s}{few}</td>")
        excl = d.get("excluded_failures", 0)
        at_to = d.get("failures_at_timeout", 0)
        rows.append(f"<tr><td class=l>{METRIC_NAMES[k]}</td><td>{n:,}</td><td>{_nb(fmt_s(d.get('mean')))}</td>"
                    + "".join(cells) + f"<td>{excl}{f' ({at_to} at timeout)' if at_to else ''}</td></tr>")
    table = (f"<table><tr><th class=l>metric</th><th>n</th><th>mean</th>{head}<th>failed excluded</th></tr>"
             f"{''.join(rows)}</table>")
    if short:
        table += ("<div class=warn>Small samples: values marked ⚠ rest on fewer samples than their "
                  f"percentile needs ({_e(SAMPLE_RULE)}). With fewer, the value is close to the largest observed "
                  "ones, not an estimate of the tail: run more requests to judge it.</div>")
    return table


def _rows(pairs: list[tuple[str, str]]) -> str:
    """A two-column table of already formatted (escaped) values; a row without a value is left out."""
    body = "".join(f"<tr><td class=l>{_e(k)}</td><td class=l>{v}</td></tr>" for k, v in pairs if v)
    return f"<table>{body}</table>"


def describe_load(load: dict) -> str:
    """'open loop: Poisson arrivals at 2 req/s, 18 requests' from the run's load dict."""
    load = load or {}
    if load.get("mode") == "closed":
        text = f"closed loop: {load.get('concurrency') or 1} concurrent streams"
    else:
        arrival = load.get("arrival") or "scheduled"
        kind = {"poisson": "Poisson", "gamma": "gamma (bursty)", "constant": "evenly spaced",
                "trace": "trace-timed"}.get(arrival, arrival)
        rate = f" at {fmt_rate(load['rate'])}" if load.get("rate") else ""
        text = f"open loop: {kind} arrivals{rate}"
        if load.get("burstiness") is not None:
            text += f" (burstiness {sig(load['burstiness'])})"
    if load.get("num_requests"):
        text += f", {load['num_requests']:,} requests"
    if load.get("duration_s"):
        text += f", {fmt_s(load['duration_s'])} of load"
    if load.get("warmup_requests"):
        text += f", first {load['warmup_requests']} as warm-up"
    if load.get("warmup_seconds"):
        text += f", first {fmt_s(load['warmup_seconds'])} as warm-up"
    return text


def describe_workload(wl: dict) -> str:
    wl = wl or {}
    kind = wl.get("kind") or "unknown"
    if kind in ("synthetic", "long-context"):
        spread = lambda x: f" ± {fmt_pct(x)}" if x else ""  # noqa: E731
        return (f"{kind}, {fmt_int(wl.get('input_tokens'))}{spread(wl.get('input_spread'))} prompt tokens, "
                f"{fmt_int(wl.get('output_tokens'))}{spread(wl.get('output_spread'))} output tokens, "
                f"language{'s' if len(wl.get('langs') or []) > 1 else ''} {', '.join(wl.get('langs') or [])}")
    if kind == "trace":
        return (f"trace {wl.get('source')}, {fmt_int(wl.get('requests'))} requests, replayed "
                f"{sig(wl.get('speedup') or 1)}x faster ({fmt_rate(wl.get('replay_rate_rps'))})")
    if kind == "jsonl":
        return f"JSONL file {wl.get('path')} ({fmt_int(wl.get('requests_in_file'))} requests)"
    return kind


def _started(ts: str | None) -> str:
    try:
        return datetime.fromisoformat(str(ts)).strftime("%Y-%m-%d %H:%M:%S UTC")
    except ValueError:
        return str(ts)


STAGE_SOURCES = {"server": "the server's per-request timelines", "llama.cpp": "llama.cpp's timings",
                 "client": "what the client saw (no server timeline)"}


def _sources(sources: dict) -> str:
    return "; ".join(f"{STAGE_SOURCES.get(k, k)} ({v:,} requests)" for k, v in (sources or {}).items())


def health_section(h: dict) -> str:
    if not h:
        return ""
    verdict = h.get("verdict")
    bad = h.get("bench_is_bottleneck")
    if not verdict:  # results written before the verdict existed
        verdict = "The bench may have distorted these latencies." if bad else "The bench kept up."
    out = f"<div class={'warn' if bad else 'info'}>{_e(verdict)}</div>"
    rows = []
    for c in h.get("checks") or []:
        status = "<span class=fail>bottleneck</span>" if c.get("bottleneck") else "<span class=pass>ok</span>"
        if "value_s" in c:
            value = fmt_s(c["value_s"]) + " (P99)"
            against = (f"{fmt_pct(c['share'])} of the {c['against']} ({fmt_s(c.get('against_s'))}); limit "
                       f"{fmt_pct(c.get('limit_share'))}" if c.get("share") is not None else NA)
        elif c.get("check") == "CPU":
            value = f"{fmt_pct(c.get('value'))} of a core"
            against = f"limit {fmt_pct(c.get('limit'))}"
        else:
            value = f"{fmt_int(c.get('value'))} sends held back"
            against = "limit 0"
        rows.append(f"<tr><td class=l>{_e(c.get('check'))}</td><td>{_e(value)}</td><td class=l>{_e(against)}</td>"
                    f"<td>{status}</td></tr>")
    if rows:
        out += ("<table><tr><th class=l>check</th><th>value</th><th class=l>judged against</th><th>status</th></tr>"
                + "".join(rows) + "</table>")
    if h.get("rule"):
        out += f"<p class=muted>{_e(h['rule'])} Python {_e(h.get('python'))} on {fmt_int(h.get('cpus'))} CPUs.</p>"
    return out + _details("Raw bench health (JSON)", h)


def tokens_section(tok: dict) -> str:
    src = tok.get("output_tokens_source") or {}
    names = {"usage": "the server's usage", "continuous_usage": "the server's per-chunk usage",
             "recount": "a local recount", "none": "nowhere"}
    chunks = tok.get("chunks") or {}
    drift = tok.get("recount_vs_usage_drift")
    pt = tok.get("prompt_tokens") or {}
    fo = tok.get("fixed_output") or {}
    pairs = [
        ("output token counts from", _e(", ".join(f"{names.get(k, k)} ({v:,} requests)" for k, v in src.items()))),
        ("chunks", _e(f"{fmt_int(chunks.get('total'))}, of which {fmt_int(chunks.get('multi_token'))} carried "
                      f"several tokens ({fmt_pct(chunks.get('multi_token_share'))}); the largest carried "
                      f"{fmt_int(chunks.get('max_tokens_per_chunk'))}") if chunks else ""),
        ("local recount vs server usage", _e(f"median {_signed_pct(drift.get('p50_rel'))}, largest "
                                             f"{fmt_pct(drift.get('max_abs_rel'))} ({fmt_int(drift.get('requests'))} "
                                             "requests)") if drift else NA),
        ("prompt tokens", _e(f"server {fmt_int(pt.get('server_total'))}, local {fmt_int(pt.get('local_total'))}, "
                             f"target {fmt_int(pt.get('target_total'))}"
                             + (f"; local vs server median {_signed_pct(pt.get('local_vs_server_rel_p50'))} (the "
                                "server's count includes its chat template)"
                                if pt.get("local_vs_server_rel_p50") is not None else "")) if pt else ""),
        ("fixed output lengths", _e(f"{fmt_int(fo.get('requests'))} requests asked for a fixed length, "
                                    f"{fmt_int(fo.get('shorter_than_max_tokens'))} answered shorter")
         if fo.get("requests") else ""),
    ]
    return _rows(pairs) + _details("Raw token figures (JSON)", tok)


def run_section(run: dict) -> str:
    caps = run.get("capabilities") or {}
    accepted = [label for key, label in (("fixed_output", "fixed output lengths"),
                                         ("include_usage", "usage in the stream"),
                                         ("continuous_usage", "usage on every chunk"),
                                         ("server_request_id_header", "our request IDs"),
                                         ("timeline_in_stream", "a stage timeline in the stream"),
                                         ("server_timing_header", "a Server-Timing header")) if caps.get(key)]
    join = run.get("join") or {}
    fetch = join.get("fetch") or {}
    join_s = join.get("mode", NA) + (f": {fmt_int(fetch.get('fetched'))} of {fmt_int(fetch.get('requested'))} "
                                     "records fetched" if fetch else "")
    pairs = [("workload", _e(describe_workload(run.get("workload") or {}))),
             ("load", _e(describe_load(run.get("load") or {}))),
             ("server supports", _e(", ".join(accepted) if accepted else "none of the optional features probed")),
             ("stage join", _e(join_s)), ("seed", _e(run.get("seed"))),
             ("command", f"<code>{_e(run.get('command'))}</code>" if run.get("command") else "")]
    raw = {k: run.get(k) for k in ("workload", "load", "capabilities", "join", "options") if run.get(k) is not None}
    return _rows(pairs) + _details("Raw run configuration (JSON)", raw)


def write_report(results: dict, path: str | Path) -> Path:
    import plotly.offline

    path = Path(path)
    s = results["summary"]
    run = results["run"]
    tp = s["throughput"]
    req = s["requests"]
    parts = [f"<h1>tailguard bench: {_e(run['target']['model'])} at {_e(run['target']['url'])}</h1>",
             f"<div class=muted>Run {_e(run['id'])}, started {_e(_started(run.get('started_at')))}. Workload: "
             f"{_e(describe_workload(run.get('workload') or {}))}. Load: {_e(describe_load(run.get('load') or {}))}."
             "</div>"]
    parts.append("<h2>Verdicts</h2>" + verdict_table(results.get("slo") or {}))
    offered = tp.get("offered_requests_per_s")
    warm = f" ({req['warmup']} warm-up excluded)" if req.get("warmup") else ""
    offered_s = ""
    if offered:
        offered_s = f" (offered {fmt_rate(offered)}"
        kept_pace = tp.get("completed_while_offered_per_s")
        if (tp.get("requests_per_s") or 0) < 0.9 * offered and kept_pace and kept_pace >= 0.9 * offered:
            # not a shortfall: the window runs on until the last answer, one long latency after the last send
            offered_s += (f"; the server kept pace, completing {fmt_rate(kept_pace)} while requests were sent: the "
                          "run's window ends with the last answer, which lowers the rate over the whole window")
        offered_s += ")"
    parts.append(
        f"<p>{req['completed']:,} of {req['measured']:,} measured requests completed{warm} in "
        f"{fmt_s(s['duration_s'])}: <b>{fmt_rate(tp.get('requests_per_s'))}</b>{offered_s}"
        + f", {fmt_rate(tp.get('output_tokens_per_s'), 'output tokens/s')}, error rate {fmt_pct(s.get('error_rate'))}."
        "</p>")
    for w in results.get("warnings") or []:
        parts.append(f"<div class=warn>{_e(sentence(w))}</div>")
    pf = s.get("percentile_failures") or {}
    failures_note = (f"<div class=warn>{_e(sentence(pf['note']))}</div>" if pf.get("failed") else
                     "<p class=muted>No request failed: every measured request is in the percentiles.</p>")
    parts.append("<h2>Latency percentiles</h2>" + metrics_table(results["metrics"]) + failures_note +
                 "<p class=muted>Measured at the client from each request's intended send time (no coordinated "
                 "omission). ITL counts every gap; a chunk of k tokens adds k-1 zero gaps. CIs: bootstrap over "
                 "requests; a verdict that judges the same requests shows the same CI.</p>")
    if results.get("classes"):
        parts.append("<h2>Traffic classes</h2>" + class_section(results))
    adv = [a for a in results.get("advisories") or [] if a["fired"]]
    parts.append("<h2>Golden rules</h2>")
    if not adv:
        parts.append("<div class=info>No golden rule fired (P99 ≤ 3 × P50 and P99 ≤ 1.5 × P95).</div>")
    for a in adv:
        cls = "warn" if a["severity"] == "warning" else "info"
        parts.append(f"<div class={cls}><b>{METRIC_NAMES.get(a['metric'], a['metric'])}: {_e(a['rule'])}</b> "
                     f"(ratio {sig(a['ratio'])}). {_e(sentence(a['action']))} "
                     f"{_e(sentence(a['note'])) if a.get('note') else ''}</div>")
    cdf = cdf_figure(results)
    figs = [("fig-cdf", cdf, cdf_caption([("A", results)]))]
    st = results.get("stages") or {}
    if st.get("mode") not in (None, "none"):
        figs.append(("fig-sankey", sankey_figure(st), ""))
        figs.append(("fig-bands", bands_figure(st), ""))
    figs.append(("fig-timeline", timeline_figure(results), ""))
    if results.get("sweep"):
        figs.insert(0, ("fig-sweep", sweep_figure(results["sweep"]), ""))
    parts.append("<h2>Figures</h2>")
    for div_id, fig, caption in figs:
        parts.append(caption + _fig_html(fig, div_id))
    if st.get("mode") not in (None, "none"):
        share = st.get("share_of_e2e") or {}
        labels = st.get("labels") or {}
        n_tail = st.get("p99_band_requests")
        rows = "".join(f"<tr><td class=l>{_e(labels.get(k, k))}</td><td>{fmt_s(st['mean_s'][k])}</td>"
                       f"<td>{fmt_pct(share.get(k, 0))}</td><td>{fmt_s(st['p99_band_mean_s'][k])}</td></tr>"
                       for k in st["stages"])
        tail_head = "P99 band mean" + (f" (n = {n_tail})" if n_tail is not None else "")
        parts.append(f"<h2>Stages</h2><p>Source: {_e(_sources(st.get('sources')))}. {_e(sentence(st['note']))}</p>"
                     f"<table><tr><th class=l>stage</th><th>mean (n = {fmt_int(st.get('requests'))})</th>"
                     f"<th>share</th><th>{tail_head}</th></tr>{rows}</table>")
        if st.get("over_20_percent"):
            parts.append("<div class=info>Stages holding more than 20% of latency (attack these first): "
                         + _e(", ".join(labels.get(k, k) for k in st["over_20_percent"])) + "</div>")
        for c in st.get("cannot_split") or []:
            parts.append(f"<div class=warn>Cannot split: {_e(c)}</div>")
    te = results.get("timing_error")
    if te:
        tt, it = te["ttft_client_minus_server_s"], te["itl_abs_error_s"]
        parts.append("<h2>Client vs server timestamps</h2>" + _rows([
            ("requests compared", fmt_int(te["requests"])),
            ("TTFT client - server, P50 / P99", f"{fmt_s(tt['p50'])} / {fmt_s(tt['p99'])}"),
            ("ITL |client - server|, P50 / P99", f"{fmt_s(it['p50'])} / {fmt_s(it['p99'])}")]))
    sl = results.get("slowest") or []
    if sl:
        labels = st.get("labels") or {}
        rows = "".join(
            f"<tr><td class=l>{_e(r['request_id'])}</td><td>{fmt_s(r['e2e_s'])}</td><td>{fmt_s(r['ttft_s'])}</td>"
            f"<td>{fmt_int(r['prompt_tokens'])}</td><td>{fmt_int(r['output_tokens'])}</td>"
            f"<td class=l>{_e(r['lang'])}</td>"
            f"<td class=l><b>{_e(labels.get(r['slow_stage'], r['slow_stage']) if r['slow_stage'] else NA)}</b></td>"
            f"<td class='l muted'>"
            f"{_e(', '.join(f'{labels.get(k, k)} {fmt_s(v)}' for k, v in (r['stages_s'] or {}).items()))}</td></tr>"
            for r in sl)
        parts.append("<h2>Slowest requests</h2><table><tr><th class=l>request</th><th>E2E</th><th>TTFT</th>"
                     "<th>prompt tokens</th><th>output tokens</th><th class=l>lang</th><th class=l>slow stage</th>"
                     f"<th class=l>stages</th></tr>{rows}</table><p class=muted>The slow stage is the one "
                     "furthest above its own median.</p>")
    bl = results.get("by_language") or {}
    tc = (results.get("tokenization_cost") or {}).get("by_language") or {}
    if bl:
        rows = []
        for lang, d in bl.items():
            c = tc.get(lang, {})
            n = d.get("requests")
            rows.append(f"<tr><td class=l>{_e(lang)}</td><td>{fmt_int(n)}</td>"
                        f"<td>{fmt_int(d.get('failed_excluded', 0))}</td><td>{fmt_s(d.get('ttft_p50_s'))}</td>"
                        f"<td>{fmt_s(d.get('ttft_p99_s'))}{_few_mark(n, 99.0)}</td>"
                        f"<td>{fmt_s(d.get('e2e_p99_s'))}{_few_mark(n, 99.0)}</td>"
                        f"<td>{fmt_int(d.get('prompt_tokens_mean'))}</td>"
                        f"<td>{fmt_s((c['encode_us_per_request_p50'] / 1e6) if c.get('encode_us_per_request_p50') is not None else None)}</td>"  # noqa: E501
                        f"<td>{sig(c['tokens_per_char']) if c.get('tokens_per_char') is not None else NA}</td>"
                        f"<td>{sig(c['per_char_cost_vs_en']) if not _missing(c.get('per_char_cost_vs_en')) else NA}"
                        f"</td><td>{fmt_s(d.get('server_tokenize_p50_s'))}</td></tr>")
        parts.append("<h2>By language and tokenization cost</h2><table><tr><th class=l>lang</th><th>n</th>"
                     "<th>failed excluded</th>"
                     "<th>TTFT P50</th><th>TTFT P99</th><th>E2E P99</th><th>prompt tokens (mean)</th>"
                     "<th>local encode per prompt</th><th>tokens/char</th><th>cost per char vs en</th>"
                     "<th>server tokenize P50</th></tr>" + "".join(rows) + "</table><p class=muted>"
                     + _e(sentence((results.get("tokenization_cost") or {}).get("note", ""))) + "</p>")
    parts.append("<h2>Tokens</h2>" + tokens_section(results.get("tokens") or {}))
    parts.append("<h2>Bench health</h2>" + health_section(results.get("bench_health") or {}))
    parts.append("<h2>Run</h2>" + run_section(run))
    wl = run.get("workload") or {}
    if wl.get("attribution"):
        parts.append(f"<p class=muted>Trace: {_e(wl['attribution'])}.</p>")
    doc = ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>tailguard bench report</title>"
           f"<style>{CSS}</style><script type='text/javascript'>{plotly.offline.get_plotlyjs()}</script></head>"
           "<body>" + "\n".join(parts) + "</body></html>")
    path.write_text(doc, encoding="utf-8")
    return path
