"""``tailguard slo report``: the weekly P99/P95 trend and SLO attainment, read from the request store.

Reads the SQLite store of :mod:`tailguard.observe.store` (table ``requests``) read-only and defensively: columns
that are missing are reported as such, never guessed. Per ISO week (UTC) it gives request counts, error rate,
E2E P50/P95/P99 and the golden-rule ratios P99/P95 and P99/P50 with the week-on-week change; per profile objective
it gives the week's value, whether it met the target, the share of hours that met it (hours with at least
``min_samples`` requests), and for latency objectives the share of requests within the threshold against the target
share (P99 <= 2 s means 99% of requests within 2 s).

Percentiles come from t-digests (``fastdigest``), built per hour and merged per week: within about 1% of exact.
Definitions follow the live monitor: E2E percentiles over successful requests, error rate = errors / served
(success + error + aborted), invalid and rejected requests excluded.

``regions`` is the region heatmap over the same weeks in 1-hour buckets (1-day buckets past 12 weeks;
``slo/region_heatmap.py``): per region and hour the P99 E2E, the clients' median RTT and the retransmit rate; ``render_report_html`` draws it with plotly
(``tailguard slo report --html FILE``), and the terminal report lists its per-region totals.
"""

from __future__ import annotations

import datetime as dt
import html
import json
import math
import sqlite3
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fastdigest import TDigest

from tailguard.slo.profiles import RATE_METRICS, Metric, Objective, SLOProfile
from tailguard.slo.region_heatmap import heatmap_html, region_heatmap, sqlite_rows

__all__ = ["ReportError", "build_report", "render_report", "render_report_html"]

REGION_BUCKET_S = 3600.0
REGION_HOURLY_WEEKS = 12  # longer reports have a column per day instead (2,016 hourly columns at most)

_SERVED = ("success", "error", "aborted")


class ReportError(RuntimeError):
    pass


def _week(ts: float) -> str:
    y, w, _ = dt.datetime.fromtimestamp(ts, dt.UTC).isocalendar()
    return f"{y}-W{w:02d}"


class _Acc:
    """Counts and digests for one slice (an hour or a week)."""

    __slots__ = ("total", "served", "errors", "e2e", "ttft", "e2e_vals", "ttft_vals", "good", "short", "long",
                 "short_vals", "long_vals")

    def __init__(self) -> None:
        self.total = self.served = self.errors = 0
        self.e2e: TDigest | None = None
        self.ttft: TDigest | None = None
        self.e2e_vals: list[float] = []
        self.ttft_vals: list[float] = []
        self.short: TDigest | None = None
        self.long: TDigest | None = None
        self.short_vals: list[float] = []
        self.long_vals: list[float] = []
        self.good: dict[tuple[str, float], int] = defaultdict(int)  # (metric, threshold) -> requests within

    def seal(self) -> None:
        for name in ("e2e", "ttft", "short", "long"):
            vals = getattr(self, f"{name}_vals")
            if vals:
                d = TDigest.from_values(vals)
                cur = getattr(self, name)
                if cur is None:
                    setattr(self, name, d)
                else:
                    cur.merge_inplace(d)
                setattr(self, f"{name}_vals", [])

    def merge(self, other: _Acc) -> None:
        other.seal()
        self.total += other.total
        self.served += other.served
        self.errors += other.errors
        for name in ("e2e", "ttft", "short", "long"):
            d = getattr(other, name)
            if d is None:
                continue
            cur = getattr(self, name)
            if cur is None:
                setattr(self, name, d.copy())
            else:
                cur.merge_inplace(d)
        for k, v in other.good.items():
            self.good[k] += v

    def q(self, name: str, p: float) -> float | None:
        d = getattr(self, name)
        return None if d is None or d.n_values == 0 else float(d.quantile(p))

    def n(self, name: str) -> int:
        d = getattr(self, name)
        return 0 if d is None else int(d.n_values)


def _columns(conn: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}


def _value(acc: _Acc, o: Objective, min_samples: int) -> tuple[float | None, int]:
    if o.metric is Metric.ERROR_RATE:
        return (acc.errors / acc.served if acc.served >= min_samples else None), acc.served
    if o.metric is Metric.LONG_CONTEXT_DECAY:
        qq = (o.percentile or 99) / 100
        ns, nl = acc.n("short"), acc.n("long")
        if ns < min_samples or nl < min_samples:
            return None, min(ns, nl)
        s, lg = acc.q("short", qq), acc.q("long", qq)
        return ((lg / s - 1.0) if s else None), min(ns, nl)
    name = o.metric.value
    n = acc.n(name)
    if n < min_samples:
        return None, n
    return acc.q(name, (o.percentile or 99) / 100), n


def _supported(o: Objective) -> str | None:
    """None if the store can evaluate the objective, else why not."""
    if not o.where.is_empty and (o.where.lanes or o.where.not_lanes or o.where.clients or o.where.regions
                                 or o.where.peak_only
                                 or o.where.min_input_tokens is not None or o.where.max_input_tokens is not None):
        return "selects on lane/client/region/peak, which the store does not record"
    if o.metric in (Metric.E2E, Metric.TTFT, Metric.ERROR_RATE, Metric.LONG_CONTEXT_DECAY):
        if o.metric is Metric.LONG_CONTEXT_DECAY and o.of is not Metric.E2E:
            return "decay of a metric other than E2E"
        return None
    if o.metric in RATE_METRICS:
        return f"{o.metric.value} is not in the request store"
    return f"{o.metric.value} percentiles are not kept per request in the store"


def build_report(db: str | Path, profiles: Iterable[SLOProfile], weeks: int = 4, now: float | None = None,
                 min_samples: int = 20, regions: bool = True) -> dict[str, Any]:
    """Read the store and compute the report (JSON-ready). Raises :class:`ReportError` on an unusable store."""
    check_report_args(weeks, min_samples)
    path = Path(_sqlite_target(db))
    if not path.exists():
        raise ReportError(f"{path}: no such request store")
    if path.is_dir():
        raise ReportError(f"{path}: is a directory, not a request store")
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error as e:
        raise ReportError(f"{path}: cannot open: {e}") from None
    try:
        return _build(conn, path, profiles, weeks, now, min_samples, regions)
    except sqlite3.DatabaseError as e:  # not a database (a YAML file, say), a corrupt one, a locked one
        raise ReportError(f"{path}: cannot read it as a SQLite request store: {e}") from None


# Ten years of weeks: more is no trend report, and far more overflows the calendar.
MAX_WEEKS = 520


def check_report_args(weeks: int, min_samples: int) -> None:
    """ReportError unless ``weeks`` is 1..MAX_WEEKS and ``min_samples`` at least 1 (an hour of no requests has no
    error rate or percentile to judge)."""
    if isinstance(weeks, bool) or not isinstance(weeks, int) or not 1 <= weeks <= MAX_WEEKS:
        raise ReportError(f"--weeks must be 1 to {MAX_WEEKS}, got {weeks}")
    if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 1:
        raise ReportError(f"--min-samples must be at least 1, got {min_samples}")


def _sqlite_target(db: str | Path) -> str:
    """The SQLite file ``db`` names (a path or sqlite:///PATH); ReportError for any other URL, its password hidden."""
    from tailguard.observe.store import is_postgres_url, sqlite_path

    text = str(db)
    if text.startswith("sqlite://"):
        return sqlite_path(text)
    if "://" not in text:
        return text
    if is_postgres_url(text):
        from tailguard.observe.stores import describe_store_target

        raise ReportError(f"{describe_store_target(text)}: the SLO report reads a SQLite request store file only, "
                          "not PostgreSQL; give --db the path of a SQLite store (tailguard serve --store FILE)")
    from tailguard.urls import redact_url

    raise ReportError(f"{redact_url(text)}: not a SQLite request store file; give --db a file path")


def _build(conn: sqlite3.Connection, path: Path, profiles: Iterable[SLOProfile], weeks: int, now: float | None,
           min_samples: int, regions: bool) -> dict[str, Any]:
    profiles = list(profiles)
    notes: list[str] = []
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "requests" not in tables:
            raise ReportError(f"{path}: no 'requests' table (is this a tailguard request store?)")
        cols = _columns(conn, "requests")
        missing = {"received_at", "e2e"} - cols
        if missing:
            raise ReportError(f"{path}: the requests table lacks {sorted(missing)}")
        now = now if now is not None else dt.datetime.now(dt.UTC).timestamp()
        # Weeks: the current ISO week and the weeks - 1 before it.
        today = dt.datetime.fromtimestamp(now, dt.UTC).date()
        monday = today - dt.timedelta(days=today.weekday())
        start = dt.datetime.combine(monday - dt.timedelta(weeks=weeks - 1), dt.time(), dt.UTC).timestamp()
        sel = ["received_at", "e2e"]
        for c in ("ttft", "outcome", "status", "business_type", "prompt_tokens"):
            if c in cols:
                sel.append(c)
            else:
                notes.append(f"column {c!r} absent: figures that need it are left out")
        idx = {c: i for i, c in enumerate(sel)}
        # Thresholds whose "good" share is counted per request, by profile slice.
        slices: dict[str, frozenset[str] | None] = {}
        for p in profiles:
            bts = p.applies_to.business_types
            slices[p.name] = frozenset(bts) if bts else None
            if (p.applies_to.lanes or p.applies_to.not_lanes or p.applies_to.clients or p.applies_to.regions) \
                    and p.name not in notes:
                notes.append(f"profile {p.name}: applies to lanes/clients/regions the store does not record; "
                             "evaluated over its business types only")
        lat_thresholds = {p.name: {(o.metric.value, o.threshold) for o in p.objectives
                                   if o.metric in (Metric.E2E, Metric.TTFT) and _supported(o) is None}
                          for p in profiles}
        hours: dict[str, dict[int, _Acc]] = {p.name: {} for p in profiles}
        hours["*"] = {}
        cur = conn.execute(f"SELECT {', '.join(sel)} FROM requests WHERE received_at >= ? ORDER BY received_at",
                           (start,))
        i_out, i_st, i_bt = idx.get("outcome"), idx.get("status"), idx.get("business_type")
        i_ttft, i_tok = idx.get("ttft"), idx.get("prompt_tokens")
        rows = 0
        for row in cur:
            rows += 1
            ts, e2e = row[0], row[1]
            if ts is None:
                continue
            if i_out is not None:
                outcome = row[i_out]
            elif i_st is not None:
                st = row[i_st] or 200
                outcome = "success" if st < 400 else "error" if st >= 500 else "invalid"
            else:
                outcome = "success"
            bt = row[i_bt] if i_bt is not None else None
            ttft = row[i_ttft] if i_ttft is not None else None
            tok = row[i_tok] if i_tok is not None else None
            hour = int(ts // 3600)
            for pname, bts in (("*", None), *slices.items()):
                if bts is not None and bt not in bts:
                    continue
                acc = hours[pname].get(hour)
                if acc is None:
                    acc = hours[pname][hour] = _Acc()
                acc.total += 1
                if outcome not in _SERVED:
                    continue
                acc.served += 1
                if outcome == "error":
                    acc.errors += 1
                if ttft is not None:
                    acc.ttft_vals.append(ttft)
                    for m, thr in lat_thresholds.get(pname, ()):
                        if m == "ttft" and ttft <= thr:
                            acc.good[(m, thr)] += 1
                if outcome != "success" or e2e is None:
                    continue
                acc.e2e_vals.append(e2e)
                for m, thr in lat_thresholds.get(pname, ()):
                    if m == "e2e" and e2e <= thr:
                        acc.good[(m, thr)] += 1
                if tok is not None:
                    if tok <= 8192:
                        acc.short_vals.append(e2e)
                    elif tok >= 65536:
                        acc.long_vals.append(e2e)
        alerts = _alert_counts(conn, tables, start, notes)
        audit = _audit_summary(conn, tables, start)
        heat = None
        if regions:
            if "region" not in cols:
                notes.append("column 'region' absent: every request is in region 'default'")
            bucket = REGION_BUCKET_S if weeks <= REGION_HOURLY_WEEKS else 86400.0
            heat = region_heatmap(sqlite_rows(conn, start, now, cols), start=start, end=max(now, start),
                                  bucket_s=bucket, metric="e2e")
    finally:
        conn.close()

    week_labels = []
    d = dt.datetime.fromtimestamp(start, dt.UTC)
    for _ in range(weeks):
        week_labels.append(_week(d.timestamp()))
        d += dt.timedelta(weeks=1)

    def weekly(h: dict[int, _Acc]) -> dict[str, _Acc]:
        out: dict[str, _Acc] = {w: _Acc() for w in week_labels}
        for hour, acc in sorted(h.items()):
            acc.seal()
            out.setdefault(_week(hour * 3600), _Acc()).merge(acc)
        return out

    allw = weekly(hours["*"])
    trend = []
    prev_ratio = None
    for w in week_labels:
        a = allw[w]
        p50, p95, p99 = (a.q("e2e", q) for q in (0.5, 0.95, 0.99))
        ratio = p99 / p95 if p99 is not None and p95 else None
        trend.append({
            "week": w, "requests": a.total, "served": a.served, "errors": a.errors,
            "error_rate": a.errors / a.served if a.served else None, "e2e_n": a.n("e2e"),
            "p50": p50, "p95": p95, "p99": p99, "p99_over_p95": ratio,
            "p99_over_p50": p99 / p50 if p99 is not None and p50 else None,
            "ttft_p99": a.q("ttft", 0.99),
            "ratio_change": (ratio - prev_ratio) if ratio is not None and prev_ratio is not None else None,
            "alerts": alerts.get(w),
        })
        if ratio is not None:
            prev_ratio = ratio

    attainment = []
    for p in profiles:
        pw = weekly(hours[p.name])
        for o in p.objectives:
            why = _supported(o)
            row: dict[str, Any] = {"profile": p.name, "objective": o.label, "target": o.describe(),
                                   "supported": why is None, "why": why, "weeks": {}}
            if why is None:
                for w in week_labels:
                    acc = pw[w]
                    value, n = _value(acc, o, min_samples)
                    hrs = [h for hh, h in hours[p.name].items() if _week(hh * 3600) == w]
                    judged = met = 0
                    for h in hrs:
                        v, _ = _value(h, o, min_samples)
                        if v is None:
                            continue
                        judged += 1
                        met += o.met_by(v)
                    cell = {"value": value, "n": n, "met": None if value is None else o.met_by(value),
                            "hours_judged": judged, "hours_met": met,
                            "hours_attainment": met / judged if judged else None}
                    if o.metric in (Metric.E2E, Metric.TTFT) and o.percentile is not None:
                        base = acc.served if o.metric is Metric.TTFT else acc.n("e2e")
                        good = acc.good.get((o.metric.value, o.threshold), 0)
                        cell["good_share"] = good / base if base else None
                        cell["target_share"] = o.percentile / 100
                    row["weeks"][w] = cell
            attainment.append(row)
    return {"db": str(path), "weeks": week_labels, "rows_read": rows, "trend": trend, "attainment": attainment,
            "audit": audit, "regions": heat, "notes": notes, "min_samples": min_samples}


def _audit_summary(conn: sqlite3.Connection, tables: set[str], start: float) -> dict[str, dict]:
    """The speculative decoding consistency audit: per sampling mode, how many reruns, mismatches and the
    distribution of the token edit distance (greedy must be 0; sampled is judged against the bound of 3)."""
    if "slo_alerts" not in tables:
        return {}
    out: dict[str, dict] = {}
    rows = conn.execute("SELECT event, figures, details FROM slo_alerts WHERE kind = 'audit' AND at >= ?",
                        (start,)).fetchall()
    for event, figures, details in rows:
        fig, det = json.loads(figures or "{}"), json.loads(details or "{}")
        d = out.setdefault(det.get("sampling", "?"), {"audited": 0, "mismatches": 0, "distances": []})
        d["audited"] += 1
        d["mismatches"] += event == "mismatch"
        d["distances"].append(int(fig.get("edit_distance", 0)))
    for d in out.values():
        dist = sorted(d.pop("distances"))
        d["max_distance"] = dist[-1]
        d["p95_distance"] = dist[min(len(dist) - 1, int(0.95 * (len(dist) - 1) + 0.5))]
        d["within_3"] = sum(x <= 3 for x in dist) / len(dist)
    return out


def _alert_counts(conn: sqlite3.Connection, tables: set[str], start: float, notes: list[str]) -> dict[str, dict]:
    """Alerts per week from an alerts table, if the store has one (the server's wiring adds it)."""
    table = next((t for t in ("slo_alerts", "alerts", "slo_records") if t in tables), None)
    if table is None:
        return {}
    cols = _columns(conn, table)
    tcol = next((c for c in ("started_at", "at", "t", "created_at") if c in cols), None)
    if tcol is None or "tier" not in cols:
        notes.append(f"table {table!r} has no time or tier column; alerts not counted")
        return {}
    where = f"WHERE {tcol} >= ?"
    if "kind" in cols:
        where += " AND kind = 'alert'"
    if "event" in cols:
        where += " AND event = 'raised'"
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for ts, tier in conn.execute(f"SELECT {tcol}, tier FROM {table} {where}", (start,)):
        if ts is not None and tier:
            out[_week(ts)][str(tier)] += 1
    return {w: dict(v) for w, v in out.items()}


def _sec(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3g}s"


def _r(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g} ms"


def render_report(rep: dict[str, Any], console: Any | None = None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = console or Console()
    con.print(f"[bold]SLO report[/] {escape(rep['db'])}: weeks {rep['weeks'][0]} .. {rep['weeks'][-1]} (UTC)")
    t = Table(title="Weekly tail trend: E2E of successful requests", title_justify="left")
    for c in ("week", "reqs", "errors", "P50", "P95", "P99", "P99/P95", "chg", "P99/P50", "alerts"):
        t.add_column(c, justify="left" if c == "week" else "right")
    for w in rep["trend"]:
        ch = w["ratio_change"]
        arrow = "-" if ch is None else (f"[red]{ch:+.2f}[/]" if ch > 0.02 else f"[green]{ch:+.2f}[/]"
                                        if ch < -0.02 else f"{ch:+.2f}")
        ratio = w["p99_over_p95"]
        ratio_s = _r(ratio) if ratio is None or ratio <= 1.5 else f"[yellow]{ratio:.2f}[/]"
        al = w.get("alerts") or {}
        t.add_row(w["week"], f"{w['requests']:,}", _r(w["error_rate"], "{:.2%}"), _sec(w["p50"]), _sec(w["p95"]),
                  _sec(w["p99"]), ratio_s, arrow, _r(w["p99_over_p50"]),
                  " ".join(f"{k[0]}{v}" for k, v in al.items()) or "-")
    con.print(t)
    con.print("[dim]P99/P95 > 1.5 and P99/P50 > 3 are the golden rules' limits: advisories (healthy lognormal "
              "traffic exceeds them too). chg: week-on-week change of P99/P95.[/]")
    last = rep["weeks"][-1]
    a = Table(title=f"SLO attainment ({last}; hours met per week, oldest first)", title_justify="left")
    for c in ("profile", "objective", "value", "", "within/target", "hours met"):
        a.add_column(c, justify="left" if c in ("profile", "objective") else "right")
    for row in rep["attainment"]:
        name = escape(row["target"])
        if not row["supported"]:
            a.add_row(row["profile"], name, "[dim]n/a[/]", "", "", f"[dim]{escape(row['why'])}[/]")
            continue
        c = row["weeks"][last]
        is_rate = "rate" in row["objective"] or "decay" in row["objective"]
        if c["value"] is None:
            val, mark = "[dim]too few[/]", ""
        else:
            val = f"{c['value']:.2%}" if is_rate else _sec(c["value"])
            mark = "[green]ok[/]" if c["met"] else "[red]miss[/]"
        good = "-"
        if c.get("good_share") is not None:
            good = f"{c['good_share']:.2%}/{c['target_share']:.0%}"
        hours = " ".join("-" if row["weeks"][w]["hours_attainment"] is None
                         else f"{row['weeks'][w]['hours_attainment']:.0%}" for w in rep["weeks"])
        a.add_row(row["profile"], name, val, mark, good, hours)
    con.print(a)
    if rep.get("audit"):
        au = Table(title="Speculative decoding consistency audit (reruns without speculation)", title_justify="left")
        for c in ("sampling", "audited", "mismatches", "max distance", "P95 distance", "within 3"):
            au.add_column(c, justify="left" if c == "sampling" else "right")
        for mode, d in rep["audit"].items():
            bad = d["mismatches"]
            au.add_row(mode, str(d["audited"]), f"[red]{bad}[/]" if bad else "0", str(d["max_distance"]),
                       str(d["p95_distance"]), f"{d['within_3']:.0%}")
        con.print(au)
        con.print("[dim]greedy output must be identical (distance 0): a mismatch is a bug; sampled output is rerun "
                  "with the same seed and judged against the bound of 3 tokens (edit distance).[/]")
    heat = rep.get("regions")
    if heat and heat["regions"]:
        rg = Table(title="Regions (all weeks; per hour or day: tailguard slo report --html)", title_justify="left")
        for c in ("region", "reqs", "P99 E2E", "median RTT", "retransmits", "with network"):
            rg.add_column(c, justify="left" if c == "region" else "right")
        for name in heat["regions"]:
            t = heat["totals"][name]
            rg.add_row(escape(name), f"{t['requests']:,}", _sec(t["latency"]), _ms(t["rtt_ms_median"]),
                       _r(t["retransmit_rate"], "{:.2%}"), f"{t['network_n']:,}")
        con.print(rg)
    for n in rep["notes"]:
        con.print(f"[dim]note: {escape(n)}[/]")
    con.print(f"[dim]{rep['rows_read']:,} records read; hours and weeks with fewer than {rep['min_samples']} "
              "requests are not judged; percentiles from t-digests (within about 1%).[/]")


_HTML_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em auto; max-width: 1400px; color: #1d2430; }
table { border-collapse: collapse; margin: .5em 0 1.5em; font-variant-numeric: tabular-nums; }
th, td { text-align: right; padding: .2em .7em; border-bottom: 1px solid #e4e6ea; white-space: nowrap; }
th:first-child, td:first-child { text-align: left; }
.muted { color: #777; }
"""


def _html_table(head: list[str], rows: list[list[str]]) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{cells}</tr>{body}</table>"


def render_report_html(rep: dict[str, Any]) -> str:
    """The report as one self-contained HTML file (plotly.js inline: it opens offline): the weekly trend, the
    per-region totals and the region heatmap (region x hour: P99 E2E, median RTT, retransmit rate)."""
    weeks = rep["weeks"]
    parts = [f"<h1>SLO report</h1><p class='muted'>{html.escape(rep['db'])}: weeks {html.escape(weeks[0])} .. "
             f"{html.escape(weeks[-1])} (UTC); {rep['rows_read']:,} records read</p>",
             "<h2>Weekly tail trend: E2E of successful requests</h2>"]
    parts.append(_html_table(
        ["week", "requests", "errors", "P50", "P95", "P99", "P99/P95", "P99/P50"],
        [[w["week"], f"{w['requests']:,}", _r(w["error_rate"], "{:.2%}"), _sec(w["p50"]), _sec(w["p95"]),
          _sec(w["p99"]), _r(w["p99_over_p95"]), _r(w["p99_over_p50"])] for w in rep["trend"]]))
    heat = rep.get("regions")
    parts.append("<h2>Regions</h2>")
    if heat and heat["regions"]:
        parts.append(_html_table(
            ["region", "requests", "P99 E2E", "median RTT", "retransmit rate", "with network figures"],
            [[name, f"{t['requests']:,}", _sec(t["latency"]), _ms(t["rtt_ms_median"]),
              _r(t["retransmit_rate"], "{:.2%}"), f"{t['network_n']:,}"]
             for name, t in ((n, heat["totals"][n]) for n in heat["regions"])]))
        parts.append(heatmap_html(heat, include_plotlyjs=True))
        unit = "hour" if heat["bucket_s"] == REGION_BUCKET_S else "day"
        parts.append(f"<p class='muted'>Per {unit} (UTC): the P99 of E2E over successful answers; the median of the "
                     "clients' RTT (the kernel's smoothed RTT at each answer's end); retransmitted segments over "
                     "segments sent while answers were written. Empty cells: no request, or no network figures.</p>")
    else:
        parts.append("<p class='muted'>No requests in these weeks.</p>")
    parts += [f"<p class='muted'>note: {html.escape(n)}</p>" for n in rep["notes"]]
    return ("<!doctype html><html lang='en'><head><meta charset='utf-8'><title>tailguard SLO report</title>"
            f"<style>{_HTML_CSS}</style></head><body>{''.join(parts)}</body></html>")
