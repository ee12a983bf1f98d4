"""The live SLO page (``GET /slo``): one self-contained HTML file that polls ``GET /slo/data`` (the monitor's
snapshot) and draws it. No external scripts, fonts or styles, so it works on an air-gapped host; every value is put in
the page with ``textContent`` (never as HTML), so a business type or request id from a client cannot inject markup.

The region heatmap (region x minute: P99 latency, median RTT, retransmit rate; ``slo/region_heatmap.py``) comes from
``GET /slo/heatmap`` every 30 s as a plotly figure, drawn with the plotly.js that the same server serves
(``GET /slo/plotly.js``, from the installed plotly package). Its labels are region names, which are label-cleaned
(letters, digits, ``_.-``) before they are recorded, so they cannot carry plotly's few text tags either.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["DASHBOARD_HTML", "json_safe"]


def json_safe(obj: Any) -> Any:
    """``obj`` with NaN and infinities as None (JSON has no NaN; browsers' JSON.parse rejects it)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


DASHBOARD_HTML = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>tailguard SLO</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 0; background: #f6f7f9; color: #1d2430; }
  header { display: flex; gap: 1.5em; align-items: center; padding: .8em 1.2em; background: #1d2430; color: #fff; }
  header h1 { font-size: 1.1em; margin: 0; font-weight: 600; }
  #tier { font-weight: 700; padding: .2em .8em; border-radius: 1em; letter-spacing: .05em; }
  .t-green { background: #2e9d5b; color: #fff; } .t-yellow { background: #f2c230; color: #222; }
  .t-orange { background: #f07c2a; color: #fff; } .t-red { background: #d93b3b; color: #fff; }
  main { display: grid; grid-template-columns: repeat(auto-fit, minmax(420px, 1fr)); gap: 1em; padding: 1em; }
  section { background: #fff; border-radius: 6px; padding: .8em 1em; box-shadow: 0 1px 2px #0002; overflow-x: auto;
            min-width: 0; }  /* a wide table scrolls inside its card instead of spilling out */
  section h2 { font-size: 1em; margin: 0 0 .5em; }
  table { border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; }
  th, td { text-align: right; padding: .15em .5em; border-bottom: 1px solid #eee; white-space: nowrap; }
  th:first-child, td:first-child { text-align: left; }
  .breach { color: #d93b3b; font-weight: 600; } .ok { color: #2e9d5b; } .muted { color: #888; }
  #error { color: #ffb3b3; } svg { width: 100%; height: 220px; }
  #heatmap svg { height: auto; }  /* plotly sizes its own figure */
  .wide { grid-column: 1 / -1; }
</style>
</head>
<body>
<header>
  <h1>tailguard SLO monitor</h1>
  <span>tier <span id="tier" class="t-green" data-tier="unknown">…</span></span>
  <span id="window"></span><span id="mode"></span><span id="updated" class="muted"></span><span id="error"></span>
</header>
<main>
  <section><h2>Live window: percentiles against tier thresholds</h2><table id="scopes"></table></section>
  <section><h2>Objectives (profiles)</h2><table id="objectives"></table></section>
  <section class="wide"><h2>Time series: E2E and TTFT percentiles (s)</h2><svg id="chart" viewBox="0 0 900 220"
    preserveAspectRatio="none"></svg><div id="legend" class="muted"></div></section>
  <section><h2>In effect now</h2><table id="active"></table></section>
  <section><h2>Recent alerts and actions</h2><table id="recent"></table></section>
  <section><h2>Golden-rule advisories</h2><table id="advisories"></table>
    <p class="muted">Advisories, not pages: healthy lognormal latency exceeds these ratios too.</p></section>
  <section><h2>Hotspots (slower than mean + 2σ of log E2E)</h2><table id="hotspots"></table></section>
  <section class="wide"><h2>Regions: P99 E2E and the clients' network, per minute</h2>
    <div id="heatmap" data-drawn="0"></div><table id="regions"></table>
    <p id="heatmap-note" class="muted"></p></section>
</main>
<script>
"use strict";
const params = new URLSearchParams(location.search);
const INTERVAL = Math.max(250, Number(params.get("interval") || 2000));
const DATA_URL = params.get("data") || location.pathname.replace(/\/?$/, "/data");  // /slo -> /slo/data
// With an API key on the server, open /slo#key=KEY: the fragment never leaves the browser, the key goes as a header.
const KEY = new URLSearchParams(location.hash.slice(1)).get("key");
const AUTH = KEY ? {Authorization: "Bearer " + KEY} : {};
const $ = (id) => document.getElementById(id);
const fmtS = (v) => v == null ? "–" : (v < 1 ? (v * 1000).toFixed(v < 0.01 ? 2 : 0) + " ms" : v.toFixed(3) + " s");
const fmtP = (v) => v == null ? "–" : (v * 100).toFixed(2) + "%";
const fmtT = (t) => t == null ? "–" : new Date(t * 1000).toLocaleTimeString();

function row(table, cells, head) {
  const tr = document.createElement("tr");
  for (const c of cells) {
    const td = document.createElement(head ? "th" : "td");
    if (c && typeof c === "object") { td.textContent = c.text; if (c.cls) td.className = c.cls; }
    else td.textContent = c == null ? "–" : String(c);
    tr.appendChild(td);
  }
  table.appendChild(tr);
}
function table(id, head, rows) {
  const t = $(id); t.replaceChildren(); row(t, head, true);
  if (!rows.length) row(t, [{text: "none", cls: "muted"}]);
  for (const r of rows) row(t, r);
}

function render(s) {
  const tier = s.tier || "green";
  const el = $("tier");
  el.textContent = tier.toUpperCase(); el.dataset.tier = tier; el.className = "t-" + tier;
  document.title = "tailguard SLO: " + tier.toUpperCase();
  $("window").textContent = "window " + Math.round(s.window_s) + " s (" + (s.peak && s.peak.peak ? "peak" : "off-peak") + ")";
  $("mode").textContent = s.actions && s.actions.dry_run ? "DRY RUN: actions are recorded, not taken" : "";
  $("updated").textContent = "evaluated " + fmtT(s.at) + " · " + s.recorded + " requests recorded";
  const ev = s.evaluation || {scopes: {}, profiles: {}, advisories: {}, hotspots: {}};
  const scopeRows = [];
  for (const [name, v] of Object.entries(ev.scopes)) {
    // Every judged metric shows its thresholds; those outside the core four (TPOT, E2E per token) get a row.
    const judged = {};
    for (const j of (v.judged || [])) judged[j.metric] = j;
    const metrics = ["e2e", "ttft", "itl", "queue_wait"];
    for (const m of Object.keys(judged)) if (!metrics.includes(m)) metrics.push(m);
    for (const m of metrics) {
      const j = judged[m];
      const x = v[m] || (j ? {n: j.samples, p99: j.value} : {});
      const th = j ? j.thresholds : null;
      const p99cls = th && x.p99 != null && x.p99 > th.yellow ? "breach" : "";
      scopeRows.push([name + " " + m, x.n, fmtS(x.p50), fmtS(x.p95), {text: fmtS(x.p99), cls: p99cls},
                      th ? fmtS(th.yellow) + " / " + fmtS(th.orange) + " / " + fmtS(th.red) : ""]);
    }
    scopeRows.push([name + " requests", v.total, "errors " + fmtP(v.error_rate), "shed " + fmtP(v.shed_rate),
                    "degraded " + fmtP(v.degradation_rate), {text: v.tier.toUpperCase(), cls: v.tier === "green" ? "ok" : "breach"}]);
  }
  table("scopes", ["scope / metric", "n", "P50", "P95", "P99", "yellow / orange / red"], scopeRows);
  const objRows = [];
  for (const [prof, p] of Object.entries(ev.profiles)) {
    for (const o of p.objectives) {
      const rate = o.percentile == null;
      objRows.push([prof + " " + o.label, rate ? fmtP(o.value) : fmtS(o.value), (o.comparison || "<=") + " " +
                    (rate ? fmtP(o.threshold) : fmtS(o.threshold)), o.samples,
                    {text: o.status, cls: o.status === "breach" ? "breach" : o.status === "ok" ? "ok" : "muted"}]);
    }
  }
  table("objectives", ["objective", "value", "target", "n", "status"], objRows);
  const rec = (r) => [r.kind + " " + r.name, r.event + (r.dry_run ? " (dry run)" : ""), r.scope, r.tier,
                      fmtT(r.at), r.figures && r.figures.tier_value != null ? fmtS(r.figures.tier_value) : ""];
  table("active", ["what", "event", "scope", "tier", "since", "value"], (s.active || []).map(rec));
  table("recent", ["what", "event", "scope", "tier", "at", "value"], (s.recent || []).slice(-15).reverse().map(rec));
  const advRows = [];
  for (const [scope, a] of Object.entries(ev.advisories || {})) {
    for (const [rule, r] of Object.entries(a.rules || {})) {
      advRows.push([scope + " " + rule, r.ratio == null ? "–" : r.ratio.toFixed(2), "> " + r.limit,
                    {text: r.active ? "active" : "off", cls: r.active ? "breach" : "ok"}]);
    }
  }
  table("advisories", ["rule", "ratio", "limit", "state"], advRows);
  const hs = (ev.hotspots && ev.hotspots.requests) || [];
  table("hotspots", ["request", "E2E", "σ", "dominant stage", "business type"],
        hs.slice(0, 10).map((h) => [h.request_id, fmtS(h.e2e), h.sigmas == null ? "–" : h.sigmas.toFixed(1),
                                     h.dominant_stage, h.business_type]));
  chart(s.history || [], ev.scopes && Object.values(ev.scopes)[0]);
}

function chart(hist, scope) {
  const svg = $("chart"); svg.replaceChildren();
  const NS = "http://www.w3.org/2000/svg", W = 900, H = 220, pad = 30;
  const series = [["E2E P99", (h) => h.e2e && h.e2e.p99, "#d93b3b"], ["E2E P50", (h) => h.e2e && h.e2e.p50, "#3b6fd9"],
                  ["TTFT P99", (h) => h.ttft && h.ttft.p99, "#8a3bd9"]];
  let ymax = 0.1;
  for (const h of hist) for (const [, f] of series) { const v = f(h); if (v != null) ymax = Math.max(ymax, v); }
  const th = scope ? scope.thresholds : null;
  if (th) ymax = Math.max(ymax, th.red * 1.1);
  const t0 = hist.length ? hist[0].at : 0, t1 = hist.length ? hist[hist.length - 1].at : 1;
  const x = (t) => pad + (W - 2 * pad) * (t1 > t0 ? (t - t0) / (t1 - t0) : 1);
  const y = (v) => H - pad - (H - 2 * pad) * v / ymax;
  const line = (pts, color, dash) => {
    const p = document.createElementNS(NS, "polyline");
    p.setAttribute("points", pts.map(([a, b]) => a.toFixed(1) + "," + b.toFixed(1)).join(" "));
    p.setAttribute("fill", "none"); p.setAttribute("stroke", color); p.setAttribute("stroke-width", "2");
    if (dash) p.setAttribute("stroke-dasharray", "6 4");
    svg.appendChild(p);
  };
  if (th) for (const [k, c] of [["yellow", "#f2c230"], ["orange", "#f07c2a"], ["red", "#d93b3b"]])
    line([[pad, y(th[k])], [W - pad, y(th[k])]], c, true);
  for (const [name, f, color] of series) {
    const pts = hist.filter((h) => f(h) != null).map((h) => [x(h.at), y(f(h))]);
    if (pts.length) line(pts.length === 1 ? [pts[0], [pts[0][0] + 1, pts[0][1]]] : pts, color);
  }
  const lab = document.createElementNS(NS, "text");
  lab.setAttribute("x", "2"); lab.setAttribute("y", "12"); lab.setAttribute("font-size", "11");
  lab.textContent = fmtS(ymax); svg.appendChild(lab);
  $("legend").textContent = series.map((s) => s[0]).join(" · ") + " · dashed: tier thresholds · " + hist.length +
                            " evaluations";
}

async function poll() {
  try {
    const r = await fetch(DATA_URL, {cache: "no-store", headers: AUTH});
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
    $("error").textContent = "";
  } catch (e) {
    $("error").textContent = "cannot reach the server: " + e.message;
  } finally {
    setTimeout(poll, INTERVAL);
  }
}
poll();

// The region heatmap: a plotly figure built by the server (go.Heatmap), drawn with the server's own plotly.js.
const HEAT_URL = params.get("heatmap") || location.pathname.replace(/\/?$/, "/heatmap");
const PLOTLY_URL = location.pathname.replace(/\/?$/, "/plotly.js");
const HEAT_INTERVAL = Math.max(INTERVAL, 30000);
let plotlyLoaded = null;
function loadPlotly() {
  if (window.Plotly) return Promise.resolve();
  if (!plotlyLoaded) plotlyLoaded = new Promise((ok, fail) => {
    const el = document.createElement("script");
    el.src = PLOTLY_URL; el.onload = ok;
    el.onerror = () => { plotlyLoaded = null; fail(new Error("plotly.js is not available on the server")); };
    document.head.appendChild(el);
  });
  return plotlyLoaded;
}
const fmtMs = (v) => v == null ? "–" : v.toFixed(v < 10 ? 3 : 1) + " ms";
async function heat() {
  try {
    const r = await fetch(HEAT_URL, {cache: "no-store", headers: AUTH});
    if (!r.ok) throw new Error("HTTP " + r.status);
    const h = await r.json(), d = h.data;
    table("regions", ["region", "requests", "P" + d.percentile + " " + d.metric.toUpperCase(), "median RTT",
                      "retransmit rate", "with network figures"],
          d.regions.map((name) => { const t = d.totals[name];
            return [name, t.requests, fmtS(t.latency), fmtMs(t.rtt_ms_median), fmtP(t.retransmit_rate), t.network_n]; }));
    $("heatmap-note").textContent = d.regions.length + " regions · " + d.buckets.length + " buckets of " +
      Math.round(d.bucket_s) + " s · from the request store, " + fmtT(h.computed_at);
    if (!h.figure) { $("heatmap-note").textContent += " · plotly is not installed on the server: figures only"; return; }
    await loadPlotly();
    await window.Plotly.react("heatmap", h.figure.data, h.figure.layout, {displaylogo: false, responsive: true});
    $("heatmap").dataset.drawn = "1";
  } catch (e) {
    $("heatmap-note").textContent = "region heatmap: " + e.message;
  } finally {
    setTimeout(heat, HEAT_INTERVAL);
  }
}
heat();
</script>
</body>
</html>
"""
