"""The region heatmap: region x time bucket -> the P99 of E2E (or TTFT) and the client network's quality (the median
RTT, the retransmit rate), from the request store's records. The ``/slo`` page draws it over the monitor's window in
1-minute buckets (``GET /slo/heatmap``), ``tailguard slo report --html`` over the report's weeks in 1-hour buckets.

A record gives its region (the region header, else the client network's region, else ``default``), its arrival
(``received_at``), E2E and TTFT, its outcome and its ``network`` section (serving/network.py). Latency follows the
live monitor: E2E over successful answers, TTFT over served requests (success, error, aborted); the network figures
come from every record that has a ``network`` section: the RTT of a request is the kernel's smoothed RTT at its last
sample (``rtt_ms.last``), and the retransmit rate of a cell is its retransmitted segments over the segments sent
(both counted between each answer's first and last sample).

A cell's percentiles are exact (linear interpolation between closest ranks, numpy's default) up to 4,096 values,
then from a t-digest of them (within about 1%).
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

from fastdigest import TDigest

__all__ = ["METRICS", "heatmap_figure", "heatmap_html", "quantile", "region_heatmap", "sqlite_rows", "store_rows"]

METRICS = ("e2e", "ttft")
_SERVED = frozenset(("success", "error", "aborted"))
EXACT_MAX = 4096  # values a cell keeps before it folds them into a t-digest
MAX_REGIONS = 20  # rows of the heatmap; the less busy regions are folded into "other"

# (region, received_at, e2e, ttft, outcome, network): network is the record's section as a dict or its JSON text.
Row = tuple[str | None, float | None, float | None, float | None, str | None, Any]


def quantile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0-1) of ``values`` by linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class _Values:
    """Raw values, folded into a t-digest past ``EXACT_MAX`` (a busy cell stays bounded)."""

    __slots__ = ("vals", "digest")

    def __init__(self) -> None:
        self.vals: list[float] = []
        self.digest: TDigest | None = None

    def add(self, v: float) -> None:
        self.vals.append(v)
        if len(self.vals) > EXACT_MAX:
            self._fold()

    def _fold(self) -> None:
        d = TDigest.from_values(self.vals)
        if self.digest is None:
            self.digest = d
        else:
            self.digest.merge_inplace(d)
        self.vals = []

    def merge(self, other: _Values) -> None:
        if other.digest is not None:
            if self.digest is None:
                self.digest = other.digest.copy()
            else:
                self.digest.merge_inplace(other.digest)
        for v in other.vals:
            self.add(v)

    @property
    def n(self) -> int:
        return len(self.vals) + (int(self.digest.n_values) if self.digest is not None else 0)

    def q(self, q: float) -> float | None:
        if self.digest is None:
            return quantile(self.vals, q)
        if self.vals:
            self._fold()
        assert self.digest is not None
        return float(self.digest.quantile(q))


class _Cell:
    __slots__ = ("requests", "latency", "rtt", "retransmits", "segments", "network")

    def __init__(self) -> None:
        self.requests = 0
        self.latency = _Values()
        self.rtt = _Values()
        self.retransmits = 0
        self.segments = 0
        self.network = 0  # records with a network section

    def merge(self, other: _Cell) -> None:
        self.requests += other.requests
        self.latency.merge(other.latency)
        self.rtt.merge(other.rtt)
        self.retransmits += other.retransmits
        self.segments += other.segments
        self.network += other.network

    def figures(self, q: float) -> tuple[float | None, float | None, float | None]:
        rate = self.retransmits / self.segments if self.segments else (0.0 if self.network and not self.retransmits
                                                                       else None)
        return self.latency.q(q), self.rtt.q(0.5), rate


def _network(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    if isinstance(raw, str | bytes):
        try:
            raw = json.loads(raw)
        except ValueError:
            return None
    return raw if isinstance(raw, dict) else None


def region_heatmap(rows: Iterable[Row], *, start: float, end: float, bucket_s: float, metric: str = "e2e",
                   percentile: float = 99.0, max_regions: int = MAX_REGIONS) -> dict[str, Any]:
    """The heatmap's figures (JSON-ready): for each region (the busiest first) and each bucket of ``bucket_s``
    seconds from ``start`` (rounded down to a whole bucket) to ``end``, the requests, the latency percentile and its
    sample count, the median RTT (ms) and the retransmit rate; ``totals`` gives the same per region over the span."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}")
    if bucket_s <= 0 or end < start:
        raise ValueError("the heatmap needs bucket_s > 0 and end >= start")
    first = math.floor(start / bucket_s) * bucket_s
    n_buckets = max(1, math.ceil((end - first) / bucket_s))
    q = percentile / 100.0
    cells: dict[str, dict[int, _Cell]] = {}
    for region, at, e2e, ttft, outcome, net_raw in rows:
        if at is None or at < start or at > end:
            continue
        b = min(int((at - first) // bucket_s), n_buckets - 1)
        row = cells.setdefault(region or "default", {})
        cell = row.get(b)
        if cell is None:
            cell = row[b] = _Cell()
        cell.requests += 1
        outcome = outcome or "success"
        if metric == "e2e":
            if outcome == "success" and e2e is not None:
                cell.latency.add(float(e2e))
        elif outcome in _SERVED and ttft is not None:
            cell.latency.add(float(ttft))
        net = _network(net_raw)
        if net is not None:
            rtt = (net.get("rtt_ms") or {}).get("last")
            if isinstance(rtt, int | float):
                cell.network += 1
                cell.rtt.add(float(rtt))
                cell.retransmits += int(net.get("retransmits") or 0)
                cell.segments += int(net.get("segments_out") or 0)
    order = sorted(cells, key=lambda r: (-sum(c.requests for c in cells[r].values()), r))
    if len(order) > max_regions:
        keep = [r for r in order if r != "other"][: max_regions - 1]
        other = cells.pop("other", {})
        for r in [r for r in cells if r not in keep]:
            for b, c in cells.pop(r).items():
                other.setdefault(b, _Cell()).merge(c)
        cells["other"] = other
        order = [*keep, "other"]

    out: dict[str, Any] = {
        "metric": metric, "percentile": percentile, "bucket_s": bucket_s, "start": first, "end": end,
        "buckets": [first + i * bucket_s for i in range(n_buckets)], "regions": order,
        "requests": [], "latency_n": [], "latency": [], "network_n": [], "rtt_ms_median": [], "retransmit_rate": [],
        "totals": {},
    }
    for r in order:
        row = cells[r]
        total = _Cell()
        lines: dict[str, list] = {k: [] for k in ("requests", "latency_n", "latency", "network_n", "rtt_ms_median",
                                                   "retransmit_rate")}
        for b in range(n_buckets):
            found = row.get(b)
            if found is None:
                for k, empty in (("requests", 0), ("latency_n", 0), ("latency", None), ("network_n", 0),
                                 ("rtt_ms_median", None), ("retransmit_rate", None)):
                    lines[k].append(empty)
                continue
            total.merge(found)
            lat, rtt_q, rate = found.figures(q)
            for k, v in (("requests", found.requests), ("latency_n", found.latency.n), ("latency", lat),
                         ("network_n", found.network), ("rtt_ms_median", rtt_q), ("retransmit_rate", rate)):
                lines[k].append(v)
        for k, line in lines.items():
            out[k].append(line)
        lat, rtt_q, rate = total.figures(q)
        out["totals"][r] = {"requests": total.requests, "latency_n": total.latency.n, "latency": lat,
                            "network_n": total.network, "rtt_ms_median": rtt_q, "retransmit_rate": rate}
    return out


# --- reading the store ---------------------------------------------------------------------------------------------
def _select(network: str, region: str = "region", ttft: str = "ttft", outcome: str = "outcome") -> str:
    return (f"SELECT {region}, received_at, e2e, {ttft}, {outcome}, {network} "
            "FROM requests WHERE received_at >= ? AND received_at <= ? ORDER BY received_at DESC LIMIT ?")


def store_rows(store: Any, since: float, until: float, limit: int = 100_000) -> list[Row]:
    """The heatmap's rows of a running server's store (SQLite or PostgreSQL), the newest ``limit`` in the span.

    Only the ``network`` section is taken out of each record's JSON, by the database (a record also holds every
    token's times: parsing it whole in Python would cost far more)."""
    from tailguard.observe.store import is_postgres_url

    expr = "(record::json)->>'network'" if is_postgres_url(store.path) else "json_extract(record, '$.network')"
    try:
        rows = store.query(_select(expr), (since, until, limit))
    except Exception:  # noqa: BLE001 - a SQLite without its JSON functions: parse the records here
        rows = store.query(_select("record"), (since, until, limit))
        return [(r[0], r[1], r[2], r[3], r[4], (_network(r[5]) or {}).get("network")) for r in rows]
    return [(r[0], r[1], r[2], r[3], r[4], r[5]) for r in rows]


def sqlite_rows(conn: Any, since: float, until: float, columns: set[str], limit: int = 5_000_000) -> list[Row]:
    """The heatmap's rows of a SQLite store opened read-only (``tailguard slo report``); a store written before
    regions or network sampling existed gives ``default`` and no network figures."""
    cols = {c: (c if c in columns else "NULL") for c in ("region", "ttft", "outcome")}
    if "record" not in columns:
        return [tuple(r) for r in conn.execute(_select("NULL", **cols), (since, until, limit))]
    try:
        rows = conn.execute(_select("json_extract(record, '$.network')", **cols), (since, until, limit)).fetchall()
    except Exception:  # noqa: BLE001 - no JSON functions in this SQLite: parse the records here
        rows = [(*r[:5], (_network(r[5]) or {}).get("network"))
                for r in conn.execute(_select("record", **cols), (since, until, limit))]
    return [tuple(r) for r in rows]


# --- drawing ---------------------------------------------------------------------------------------------------------
def _label(t: float, bucket_s: float) -> str:
    d = dt.datetime.fromtimestamp(t, dt.UTC)
    return d.strftime("%Y-%m-%d %H:%M" if bucket_s < 86400 else "%Y-%m-%d")


def heatmap_figure(data: dict[str, Any], title: str | None = None) -> Any:
    """A plotly figure of the heatmap: the latency percentile, the median RTT and the retransmit rate side by side,
    one row per region, one column per bucket (UTC). Needs plotly (the ``report`` extra)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    x = [_label(t, data["bucket_s"]) for t in data["buckets"]]
    y = data["regions"] or ["(no requests)"]
    pct = f"P{data['percentile']:g}"
    metric = "E2E" if data["metric"] == "e2e" else "TTFT"
    titles = (f"{pct} {metric} (s)", "median RTT (ms)", "retransmit rate")
    fig = make_subplots(rows=1, cols=3, shared_yaxes=True, subplot_titles=titles, horizontal_spacing=0.07)
    empty = [[None] * len(x)]
    panels = (("latency", "YlOrRd", "%{z:.3f} s"), ("rtt_ms_median", "Blues", "%{z:.3f} ms"),
              ("retransmit_rate", "Reds", "%{z:.2%}"))
    for i, (key, scale, fmt) in enumerate(panels):
        z = data[key] or empty
        n = data["latency_n"] if key == "latency" else data["network_n"]
        fig.add_trace(go.Heatmap(
            z=z, x=x, y=y, customdata=n or empty, colorscale=scale, name=titles[i], hoverongaps=False,
            colorbar={"x": 0.285 + i * 0.357, "len": 0.9, "thickness": 10, "title": {"text": ""}},
            hovertemplate=f"%{{y}} %{{x}}<br>{titles[i]}: {fmt}<br>n = %{{customdata}}<extra></extra>",
        ), row=1, col=i + 1)
    span = "1 min" if data["bucket_s"] == 60 else "1 h" if data["bucket_s"] == 3600 else f"{data['bucket_s']:g} s"
    fig.update_layout(
        title={"text": title or f"Regions over time ({span} buckets, UTC)", "x": 0.01},
        height=170 + 26 * len(y), margin={"l": 90, "r": 20, "t": 70, "b": 50}, template="plotly_white",
    )
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(type="category", tickangle=-30, nticks=12)
    return fig


def heatmap_html(data: dict[str, Any], include_plotlyjs: bool | str = True, div_id: str = "region-heatmap") -> str:
    """The heatmap as an HTML fragment (plotly.js inline by default: the file opens offline)."""
    return str(heatmap_figure(data).to_html(full_html=False, include_plotlyjs=include_plotlyjs, div_id=div_id,
                                            config={"displaylogo": False, "responsive": True}))
