"""The stage join: where each request's end-to-end time went.

Against tailguard, each request is joined by its ID with the server's timeline (the ``tailguard`` object of the last
SSE chunk, the ``Server-Timing`` header of a non-streamed answer, or ``GET /v1/requests/{id}``) and its client-side
E2E is split into tokenize, queue, prefill, decode and stream (server) plus network/client (the rest: the request's
trip in, the response's trip out, and the bench's own send lag). The six add up to the client's E2E.

Against other servers only what can be split is split: llama.cpp's ``timings`` give prefill and decode; otherwise the
client sees "before first token" (tokenize + queue + prefill + network, inseparable from outside), "decode" (first to
last content chunk) and "tail" (last chunk to end of response). The report says which split each request got.
Every field of a server record is optional: a record without usable stages is "cannot split", never an error.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np

from tailguard.bench.client import RequestResult
from tailguard.bench.metrics import RequestMetrics

SERVER_STAGES = ("tokenize", "queue", "prefill", "decode", "stream")
FULL_STAGES = (*SERVER_STAGES, "network_client")
LLAMA_STAGES = ("prefill", "decode", "unsplit")
CLIENT_STAGES = ("before_first_token", "decode", "tail")
STAGE_LABELS = {
    "tokenize": "tokenize", "queue": "queue wait", "prefill": "prefill", "decode": "decode", "stream": "stream",
    "network_client": "network/client", "unsplit": "tokenize+queue+network (unsplit)",
    "before_first_token": "before first token (unsplit)", "tail": "end of stream",
}
CANNOT_SPLIT = {
    "server": [],
    "llama.cpp": ["tokenize, queue wait and network are not reported by llama.cpp's timings: they stay together"],
    "client": ["tokenize, queue wait, prefill and network before the first token (the server exposes no "
               "per-request timeline)", "decode vs stream (server-side) vs network"],
    "none": ["no request completed"],
}


def _num(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if np.isfinite(v) and v >= 0 else None


def server_stages(obj: dict | None) -> tuple[dict[str, float], float | None] | None:
    """(stages, server E2E) from a tailguard record or stage object; None if it lacks any stage."""
    if not isinstance(obj, dict):
        return None
    st = obj.get("stages")
    if not isinstance(st, dict):
        return None
    out = {}
    for k in SERVER_STAGES:
        v = _num(st.get(k))
        if v is None:
            return None
        out[k] = v
    return out, _num(obj.get("e2e"))


def _from_server_timing(st: dict[str, float] | None) -> tuple[dict[str, float], float | None] | None:
    if not st or not all(k in st for k in SERVER_STAGES):
        return None
    return {k: st[k] for k in SERVER_STAGES}, st.get("total")


def split_request(m: RequestMetrics, res: RequestResult) -> None:
    """Fill ``m.stages`` and ``m.stage_source`` from the best source this request has."""
    if not m.ok or m.e2e is None:
        return
    got = server_stages(res.record) or server_stages(res.tailguard) or _from_server_timing(res.server_timing)
    if got is not None:
        stages, _server_e2e = got
        # the server's stages add up to its E2E by construction; summing them (rather than taking its rounded
        # e2e field) keeps the six parts adding up to the client's E2E to the last digit
        total = sum(stages.values())
        stages = dict(stages)
        stages["network_client"] = max(0.0, m.e2e - total)
        if total > m.e2e + 0.001:  # the server claims more time than the client saw: durations disagree
            scale = m.e2e / total if total > 0 else 0.0
            stages = {k: v * scale for k, v in stages.items() if k != "network_client"}
            stages["network_client"] = 0.0
        m.stages, m.stage_source = stages, "server"
        return
    lt = res.llama_timings
    if isinstance(lt, dict) and _num(lt.get("prompt_ms")) is not None and _num(lt.get("predicted_ms")) is not None:
        pre, dec = _num(lt["prompt_ms"]) / 1e3, _num(lt["predicted_ms"]) / 1e3
        m.stages = {"prefill": pre, "decode": dec, "unsplit": max(0.0, m.e2e - pre - dec)}
        m.stage_source = "llama.cpp"
        return
    m.stages = {"before_first_token": m.ttft or 0.0, "decode": m.decode or 0.0, "tail": m.tail or 0.0}
    m.stage_source = "client"


async def fetch_records(transport, base_url: str, pairs: list[tuple[RequestMetrics, RequestResult]],
                        limit: int, seed: int = 0, concurrency: int = 16,
                        headers: dict[str, str] | None = None) -> dict:
    """GET /v1/requests/{id} for up to ``limit`` requests: every one of the slowest 1%, then a random sample."""
    ok = [(m, r) for m, r in pairs if m.ok]
    if not ok or limit <= 0:
        return {"requested": 0, "fetched": 0}
    ok.sort(key=lambda p: p[0].e2e or 0.0, reverse=True)
    top = max(1, len(ok) // 100)
    chosen = ok[:top]
    rest = ok[top:]
    random.Random(seed).shuffle(rest)
    chosen += rest[: max(0, limit - len(chosen))]
    chosen = chosen[:limit]
    sem = asyncio.Semaphore(concurrency)
    fetched = 0
    statuses: dict[int, int] = {}

    async def one(res: RequestResult) -> None:
        nonlocal fetched
        rid = res.server_request_id or res.request_id
        async with sem:
            try:
                status, obj = await transport.get_json(base_url.rstrip("/") + f"/v1/requests/{rid}", headers)
            except Exception:
                status, obj = -1, None
        statuses[status] = statuses.get(status, 0) + 1
        if status == 200 and isinstance(obj, dict):
            res.record = obj
            fetched += 1

    # a first one alone: a server without the endpoint answers 404 and we stop there (after a few short retries:
    # a server may close a record a moment after the client has read the last byte)
    for attempt in range(4):
        await one(chosen[0][1])
        if fetched or statuses.get(404, 0) == 0:
            break
        await asyncio.sleep(0.05 * (attempt + 1))
    if fetched:
        await asyncio.gather(*(one(r) for _, r in chosen[1:]))
    return {"requested": len(chosen) if fetched else 1, "fetched": fetched,
            "statuses": {str(k): v for k, v in statuses.items()}}


def stage_report(measured: list[RequestMetrics]) -> dict:
    ok = [m for m in measured if m.ok and m.stages]
    if not ok:
        return {"mode": "none", "cannot_split": CANNOT_SPLIT["none"], "sources": {}}
    sources: dict[str, int] = {}
    for m in ok:
        sources[m.stage_source] = sources.get(m.stage_source, 0) + 1
    mode = max(sources, key=lambda k: sources[k])
    names = {"server": FULL_STAGES, "llama.cpp": LLAMA_STAGES, "client": CLIENT_STAGES}[mode]
    rows = [m for m in ok if m.stage_source == mode]
    mat = np.array([[m.stages.get(k, 0.0) for k in names] for m in rows])
    e2e = np.array([m.e2e for m in rows])
    mean = mat.mean(axis=0)
    share = mean / e2e.mean() if e2e.mean() > 0 else np.zeros_like(mean)
    med = np.median(mat, axis=0)
    for m in rows:  # the stage that made the request slow: the largest excess over that stage's median
        excess = [m.stages.get(k, 0.0) - med[j] for j, k in enumerate(names)]
        m.slow_stage = names[int(np.argmax(excess))]
    bands = []
    c50, c90, c99 = (float(np.percentile(e2e, q)) for q in (50, 90, 99))
    masks = [("<= P50", e2e <= c50), ("P50-P90", (e2e > c50) & (e2e <= c90)),
             ("P90-P99", (e2e > c90) & (e2e <= c99)), ("> P99", e2e > c99)]
    for label, sel in masks:
        if not sel.any():
            bands.append({"band": label, "requests": 0, "mean_s": {k: None for k in names}, "e2e_mean_s": None})
            continue
        bands.append({"band": label, "requests": int(sel.sum()),
                      "mean_s": {k: float(mat[sel, j].mean()) for j, k in enumerate(names)},
                      "e2e_mean_s": float(e2e[sel].mean())})
    p99_sel = e2e >= c99
    return {
        "mode": mode,
        "stages": list(names),
        "labels": {k: STAGE_LABELS[k] for k in names},
        "sources": sources,
        "requests": len(rows),
        "mean_s": {k: float(mean[j]) for j, k in enumerate(names)},
        "share_of_e2e": {k: float(share[j]) for j, k in enumerate(names)},
        "p99_band_mean_s": {k: float(mat[p99_sel, j].mean()) for j, k in enumerate(names)},
        "p99_band_requests": int(p99_sel.sum()),  # how few requests the "slowest 1%" figures rest on
        "bands": bands,
        "over_20_percent": [k for j, k in enumerate(names) if share[j] > 0.20],
        "cannot_split": CANNOT_SPLIT[mode],
        "note": "The stages add up to the client's E2E for every request; network/client is the client's E2E minus "
                "the server's",
    }


def timing_error(pairs: list[tuple[RequestMetrics, RequestResult]]) -> dict | None:
    """Client vs server timestamps where full records (with token_sent) were fetched.

    For each request: client TTFT (from the actual send) minus server TTFT (received -> first token sent), and each
    client inter-token gap minus the server's gap for the same token. Differences are the network, the kernel and the
    bench's own reading delay.
    """
    ttft_d, gap_d = [], []
    for m, r in pairs:
        rec = r.record
        if not (m.ok and isinstance(rec, dict) and r.first_token_at is not None):
            continue
        sent = rec.get("token_sent")
        ttft_s = _num(rec.get("ttft"))
        if ttft_s is not None:
            ttft_d.append((r.first_token_at - r.sent) - ttft_s)
        if not isinstance(sent, list) or not sent:
            continue
        client = []
        for t, k in zip(r.chunk_times, m.chunk_tokens or [1] * len(r.chunk_times)):
            client.extend([t] * k)
        if len(client) != len(sent):
            continue
        srv = np.asarray(sent, dtype=float)
        cl = np.asarray(client)
        gap_d.extend((np.diff(cl) - np.diff(srv)).tolist())
    if not ttft_d:
        return None

    def q(v, p):
        a = np.asarray(v, dtype=float)
        return float(np.percentile(a, p)) if a.size else None

    return {
        "requests": len(ttft_d),
        "ttft_client_minus_server_s": {"p50": q(ttft_d, 50), "p99": q(ttft_d, 99), "max": max(ttft_d)},
        "itl_abs_error_s": {"p50": q(np.abs(gap_d), 50) if gap_d else None,
                            "p99": q(np.abs(gap_d), 99) if gap_d else None,
                            "max": float(np.max(np.abs(gap_d))) if gap_d else None, "gaps": len(gap_d)},
        "note": "client TTFT is taken from the actual send here (not the intended one) to compare like with like",
    }
