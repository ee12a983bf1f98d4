"""Hotspot analysis of stored records: layers and stages slower than mean + 2 sigma.

Layers: the sampled internals (engine/internals.py) give each instrumented step a wall time per layer. Prefill and
decode steps differ by orders of magnitude, so each kind is judged apart. Two views per kind:

* across layers: each layer's mean time over every sampled step of that kind; a layer is hot when its mean is above
  mean + sigma x std of the layer means (a layer that is slow everywhere: a bigger shape, a slow kernel);
* per step: how often each layer was above its own step's mean + sigma x std (a layer that is slow now and then:
  a page fault, a preempted thread), as a share of the steps.

Stages: each stage (tokenize, queue, prefill, decode, stream) across requests; a request is marked for every stage
above that stage's mean + sigma x std, with its z-score, and says whether it carries sampled internals (its layer
times then show where inside the model a slow prefill or decode went).

The statistics are the population mean and standard deviation. With n values the largest possible z-score is
sqrt(n - 1), so mean + 2 sigma can only mark something among at least 6 layers or requests; ``min_samples`` (default
6) says so instead of reporting nothing silently.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tailguard.observe.timeline import STAGES

__all__ = ["DEFAULT_SIGMA", "HotspotError", "find_hotspots", "load_records", "render_hotspots"]

DEFAULT_SIGMA = 2.0
DEFAULT_MIN_SAMPLES = 6
_TIMES = ("layer_ms", "attn_ms", "mlp_ms")


class HotspotError(RuntimeError):
    pass


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def _layer_view(steps: list[dict[str, Any]], sigma: float, min_samples: int) -> dict[str, Any]:
    """One kind's steps (all with the same number of layers) -> layer means, hot layers, per-step hot shares."""
    n_layers = len(steps[0]["layer_ms"])
    means = {key: [sum(s[key][i] for s in steps) / len(steps) for i in range(n_layers)] for key in _TIMES}
    view: dict[str, Any] = {"steps": len(steps), "layers": n_layers,
                            "layer_ms_mean": [round(v, 4) for v in means["layer_ms"]],
                            "attn_ms_mean": [round(v, 4) for v in means["attn_ms"]],
                            "mlp_ms_mean": [round(v, 4) for v in means["mlp_ms"]],
                            "threshold_ms": None, "hot_layers": [], "hot_share": [0.0] * n_layers,
                            "judged": n_layers >= min_samples}
    if not view["judged"]:
        return view
    mu, sd = _mean_std(means["layer_ms"])
    view["threshold_ms"] = round(mu + sigma * sd, 4)
    for i, v in enumerate(means["layer_ms"]):
        if sd > 0 and v > mu + sigma * sd:
            # Which half of the layer carries the excess: the part furthest above its own mean over the layers.
            attn_mu, _ = _mean_std(means["attn_ms"])
            mlp_mu, _ = _mean_std(means["mlp_ms"])
            part = "attention" if means["attn_ms"][i] - attn_mu >= means["mlp_ms"][i] - mlp_mu else "mlp"
            view["hot_layers"].append({"layer": i, "ms": round(v, 4), "z": round((v - mu) / sd, 2), "part": part})
    hot_counts = [0] * n_layers
    for s in steps:
        m, d = _mean_std(s["layer_ms"])
        for i, v in enumerate(s["layer_ms"]):
            if d > 0 and v > m + sigma * d:
                hot_counts[i] += 1
    view["hot_share"] = [round(c / len(steps), 4) for c in hot_counts]
    return view


def _stage_view(records: list[dict[str, Any]], sigma: float, min_samples: int) -> dict[str, Any]:
    stats: dict[str, Any] = {}
    slow: list[dict[str, Any]] = []
    for stage in STAGES:
        values = [r["stages"][stage] for r in records if r.get("stages", {}).get(stage) is not None]
        if len(values) < min_samples:
            stats[stage] = {"samples": len(values), "mean_s": None, "std_s": None, "threshold_s": None}
            continue
        mu, sd = _mean_std(values)
        thr = mu + sigma * sd
        stats[stage] = {"samples": len(values), "mean_s": mu, "std_s": sd, "threshold_s": thr}
        if sd <= 0:
            continue
        for r in records:
            v = r.get("stages", {}).get(stage)
            if v is not None and v > thr:
                slow.append({"request_id": r["request_id"], "stage": stage, "seconds": v, "threshold_s": thr,
                             "z": round((v - mu) / sd, 2), "sampled": bool(r.get("internals"))})
    slow.sort(key=lambda e: -e["z"])
    return {"stats": stats, "slow": slow}


def find_hotspots(records: Iterable[dict[str, Any]], sigma: float = DEFAULT_SIGMA,
                  min_samples: int = DEFAULT_MIN_SAMPLES) -> dict[str, Any]:
    """Hot layers (per step kind) and slow stages over ``records`` (dicts with ``request_id``, ``stages`` and, for
    sampled ones, ``internals``, as the store returns them)."""
    if sigma <= 0:
        raise HotspotError(f"sigma must be positive, not {sigma}")
    if min_samples < 2:
        raise HotspotError(f"min_samples must be at least 2, not {min_samples}")
    records = list(records)
    by_kind: dict[str, list[dict[str, Any]]] = {}
    sampled = 0
    for r in records:
        internals = r.get("internals")
        if not internals:
            continue
        sampled += 1
        for step in internals.get("steps", ()):
            if step.get("layer_ms"):
                by_kind.setdefault(step["kind"], []).append(step)
    layers: dict[str, Any] = {}
    for kind, steps in sorted(by_kind.items()):
        # One model per store as a rule; should several have written it, the most common depth is the one judged.
        width = Counter(len(s["layer_ms"]) for s in steps).most_common(1)[0][0]
        layers[kind] = _layer_view([s for s in steps if len(s["layer_ms"]) == width], sigma, min_samples)
    return {"sigma": sigma, "records": len(records), "sampled_records": sampled, "layers": layers,
            "stages": _stage_view(records, sigma, min_samples)}


# --- reading the store --------------------------------------------------------------------------------------------
def _record(row: Any, has_internals: bool) -> dict[str, Any]:
    raw = row["internals"] if has_internals else None
    return {
        "request_id": row["request_id"], "received_at": row["received_at"],
        "stages": {"tokenize": row["tokenize"], "queue": row["queue"], "prefill": row["prefill"],
                   "decode": row["decode"], "stream": row["stream_time"]},
        "internals": json.loads(raw) if raw else None,
    }


def load_records(target: str, since: float | None = None, limit: int = 10_000) -> list[dict[str, Any]]:
    """The most recent ``limit`` successful records (since a unix time) from a SQLite file (read-only) or a
    postgresql:// URL. A SQLite file older than schema 4 has no internals: its stages are still judged."""
    from tailguard.observe.store import is_postgres_url, sqlite_path

    where = "outcome = 'success'" + (" AND received_at >= ?" if since is not None else "")
    params: tuple = (since,) if since is not None else ()
    if is_postgres_url(target):
        from tailguard.observe.stores import open_store

        try:
            store = open_store(target, read_only=True)
        except (OSError, RuntimeError, ValueError) as exc:
            raise HotspotError(f"cannot read the store: {exc}") from exc
        try:
            rows = store.query(f"SELECT * FROM requests WHERE {where} ORDER BY id DESC LIMIT ?", (*params, limit))
        finally:
            store.close()
        return [_record(r, True) for r in rows]
    path = Path(sqlite_path(target)).expanduser()
    if not path.is_file():
        raise HotspotError(f"no request store at {path}")
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        conn.row_factory = sqlite3.Row
        try:
            cols = {r[1] for r in conn.execute("PRAGMA table_info(requests)")}
            if not cols:
                raise HotspotError(f"{path} has no requests table: not a tailguard request store")
            rows = conn.execute(f"SELECT * FROM requests WHERE {where} ORDER BY id DESC LIMIT ?",
                                (*params, limit)).fetchall()
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        raise HotspotError(f"{path}: {exc}") from exc
    return [_record(r, "internals" in cols) for r in rows]


def render_hotspots(rep: dict[str, Any], top: int = 20) -> None:
    print(f"{rep['records']} records, {rep['sampled_records']} with sampled internals; hot = above mean + "
          f"{rep['sigma']:g} sigma")
    if not rep["layers"]:
        print("layers: no sampled internals (serve with --internals-sample-rate)")
    for kind, v in rep["layers"].items():
        print(f"\n{kind} steps: {v['steps']}, {v['layers']} layers")
        if not v["judged"]:
            print("  too few layers to judge")
        print(f"  {'layer':>5} {'ms':>9} {'attn ms':>9} {'mlp ms':>9} {'hot in':>7}")
        hot = {h["layer"]: h for h in v["hot_layers"]}
        for i in range(v["layers"]):
            mark = f"  HOT z={hot[i]['z']} ({hot[i]['part']})" if i in hot else ""
            print(f"  {i:>5} {v['layer_ms_mean'][i]:>9.3f} {v['attn_ms_mean'][i]:>9.3f} {v['mlp_ms_mean'][i]:>9.3f} "
                  f"{v['hot_share'][i]:>6.0%}{mark}")
    st = rep["stages"]
    print("\nstages:")
    for stage, s in st["stats"].items():
        if s["mean_s"] is None:
            print(f"  {stage:<9} {s['samples']} samples: too few to judge")
        else:
            print(f"  {stage:<9} mean {s['mean_s'] * 1e3:9.2f} ms  std {s['std_s'] * 1e3:9.2f} ms  "
                  f"threshold {s['threshold_s'] * 1e3:9.2f} ms")
    if st["slow"]:
        print(f"\nslow stages (top {min(top, len(st['slow']))} of {len(st['slow'])}):")
        for e in st["slow"][:top]:
            print(f"  {e['request_id']:<40} {e['stage']:<9} {e['seconds'] * 1e3:9.2f} ms  z={e['z']:<6}"
                  f"{'  sampled' if e['sampled'] else ''}")
