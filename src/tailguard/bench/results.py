"""The stable outputs: ``results.json`` (schema ``tailguard.bench/v1``) and ``requests.csv``.

Schema (keys are only ever added, never renamed or removed within v1; times are seconds):

``schema``, ``tool``, ``run`` (target, load, workload, seed, options, capabilities; ``command`` with its secrets
masked), ``summary`` (requests, duration, error rate, throughput, ``percentile_failures``: how many failed requests
the percentiles leave out, or put at the timeout), ``metrics`` (ttft, itl, tpot, e2e, ttfb, send_lag: count, mean,
std, min, max, ``excluded_failures``, ``failures_at_timeout`` and ``percentiles`` p50/p90/p95/p99/p99.9 each with
``value``, ``ci`` [lo, hi] and ``samples_beyond``), ``tokens``,
``stages``, ``timing_error``, ``slo`` (one verdict per profile, with goodput), ``advisories`` (golden rules),
``slowest``, ``by_language``, ``tokenization_cost`` (L1), ``bench_health``, ``warnings``, ``sweep`` (when swept),
``samples`` (raw per-request values that ``tailguard bench compare`` resamples; with traffic classes, ``class`` and
``failed_class`` name each one's class) and, in a run with traffic classes, ``classes`` (the definitions, and per
class its requests, percentiles, goodput and SLO verdicts).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from tailguard.bench.metrics import RequestMetrics
from tailguard.bench.stages import FULL_STAGES

SCHEMA = "tailguard.bench/v1"
MAX_ITL_SAMPLES = 200_000


def _r(x: float | None, nd: int = 6) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(float(x), nd)


def samples(measured: list[RequestMetrics], seed: int = 0, classes: bool = False) -> dict:
    ok = [m for m in measured if m.ok]
    itl_vals, itl_req = [], []
    rows = ok
    total = sum(len(m.itl) for m in ok)
    subsampled = False
    if total > MAX_ITL_SAMPLES:  # keep whole requests, chosen at random, so clusters stay intact
        rng = np.random.default_rng(seed)
        order = rng.permutation(len(ok))
        rows, n = [], 0
        for i in order:
            if n + len(ok[i].itl) > MAX_ITL_SAMPLES:
                break
            rows.append(ok[i])
            n += len(ok[i].itl)
        subsampled = True
    for m in rows:
        itl_vals.extend(_r(v) for v in m.itl)
        itl_req.extend([m.index] * len(m.itl))
    out = {
        "index": [m.index for m in ok],
        "intended_s": [_r(m.intended) for m in ok],
        "ttft": [_r(m.ttft) for m in ok],
        "e2e": [_r(m.e2e) for m in ok],
        "tpot": [_r(m.tpot) for m in ok],
        "output_tokens": [m.output_tokens for m in ok],
        "itl": {"values": itl_vals, "request": itl_req, "subsampled": subsampled},
        "failed_intended_s": [_r(m.intended) for m in measured if not m.ok],
    }
    if classes:  # aligned with ``index`` and ``failed_intended_s``: compare filters each class's values by these
        out["class"] = [m.traffic_class for m in ok]
        out["failed_class"] = [m.traffic_class for m in measured if not m.ok]
    return out


CSV_COLUMNS = [
    "index", "request_id", "server_request_id", "warmup", "ok", "status", "error", "lang", "business_type", "user",
    "intended_s", "send_lag_s", "ttfb_s", "ttft_s", "e2e_s", "tpot_s", "decode_s", "tail_s", "itl_mean_s",
    "itl_p50_s", "itl_max_s", "chunks", "multi_token_chunks", "max_tokens_per_chunk", "prompt_tokens",
    "prompt_tokens_local", "prompt_tokens_target", "output_tokens", "output_tokens_source", "output_tokens_local",
    "max_tokens", "finish_reason", "stage_source", "slow_stage",
    *[f"stage_{s}_s" for s in FULL_STAGES], "stage_before_first_token_s", "stage_tail_s", "stage_unsplit_s",
    "class",  # last, so that readers by position keep working
]


def write_csv(path: Path, metrics: list[RequestMetrics]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for m in metrics:
            itl = np.asarray(m.itl) if m.itl else None
            st = m.stages or {}
            w.writerow([
                m.index, m.request_id, m.server_request_id or "", int(m.warmup), int(m.ok), m.status,
                (m.error or "").replace("\n", " "), m.lang, m.business_type or "", m.user or "",
                _r(m.intended), _r(m.send_lag), _r(m.ttfb), _r(m.ttft), _r(m.e2e), _r(m.tpot), _r(m.decode),
                _r(m.tail), _r(itl.mean()) if itl is not None else "", _r(float(np.median(itl))) if itl is not None
                else "", _r(itl.max()) if itl is not None else "", m.chunks, m.multi_token_chunks,
                max(m.chunk_tokens, default=0), m.prompt_tokens if m.prompt_tokens is not None else "",
                m.prompt_tokens_local if m.prompt_tokens_local is not None else "",
                m.prompt_tokens_target if m.prompt_tokens_target is not None else "",
                m.output_tokens if m.output_tokens is not None else "", m.output_tokens_source,
                m.output_tokens_local if m.output_tokens_local is not None else "", m.max_tokens,
                m.finish_reason or "", m.stage_source, m.slow_stage or "",
                *[_r(st.get(s)) if s in st else "" for s in FULL_STAGES],
                *[_r(st.get(s)) if s in st else "" for s in ("before_first_token", "tail", "unsplit")],
                m.traffic_class or "",
            ])


def _clean(obj: Any) -> Any:
    """NaN/inf -> null, numpy scalars -> Python, so the JSON is strict and portable."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        x = float(obj)
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    return obj


def write_json(path: Path, results: dict) -> None:
    path.write_text(json.dumps(_clean(results), ensure_ascii=False, separators=(",", ":")), encoding="utf-8")


def load_results(path: str | Path) -> dict:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or not str(data.get("schema", "")).startswith("tailguard.bench/"):
        raise ValueError(f"{path}: not a tailguard bench results file")
    return data
