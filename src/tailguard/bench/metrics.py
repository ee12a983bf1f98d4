"""From what the client saw to the numbers: per-request latencies, token counts, and run-wide aggregates.

Definitions (docs/metrics.md; the same names as the server's, measured at the client from the *intended* send time):

* TTFT: intended send -> first chunk carrying content (a role-only first chunk is not a token).
* ITL: every gap between consecutive content chunks; a chunk that carries k tokens adds k-1 zero gaps (and is
  reported as a multi-token chunk).
* TPOT: (E2E - TTFT) / (output tokens - 1), per request.
* E2E: intended send -> last byte of the response.
* Output tokens: the server's ``usage.completion_tokens``; where usage is missing, a local recount of the text
  (and the drift between recount and usage, measured on the requests that have both, is reported).
* Tokens per chunk: exact when the server sends cumulative usage on every chunk (vLLM's continuous usage stats);
  otherwise the usage total is spread over the chunks by a local recount of each chunk's text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tailguard.bench.client import RequestResult
from tailguard.bench.stats import describe


@dataclass(slots=True)
class RequestMetrics:
    index: int
    request_id: str
    server_request_id: str | None
    warmup: bool
    ok: bool
    status: int
    error: str | None
    lang: str
    business_type: str | None
    user: str | None
    intended: float  # seconds from the run's start
    send_lag: float
    ttfb: float | None  # intended -> response headers
    ttft: float | None
    e2e: float | None
    tpot: float | None
    decode: float | None  # first -> last content chunk, at the client
    tail: float | None  # last content chunk -> end of the response
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    chunk_tokens: list[int] = field(default_factory=list)
    multi_token_chunks: int = 0
    output_tokens: int | None = None
    output_tokens_source: str = "none"  # usage | continuous_usage | recount | none
    output_tokens_local: int | None = None
    prompt_tokens: int | None = None  # server usage
    prompt_tokens_local: int | None = None
    prompt_tokens_target: int | None = None
    max_tokens: int = 0
    finish_reason: str | None = None
    stages: dict[str, float] | None = None  # filled by the stage join
    stage_source: str = "none"
    slow_stage: str | None = None
    chunk_times: list[float] = field(default_factory=list)  # seconds from the run's start (for the timeline chart)
    traffic_class: str | None = None  # the request's traffic class, None in a run without classes


def _distribute(total: int, weights: list[int], n: int) -> list[int]:
    """``n`` chunks, ``total`` tokens, each chunk at least one: the extra tokens go where the recount puts them."""
    base = [1] * n
    extra = total - n
    w = [max(0, x - 1) for x in weights]
    s = sum(w)
    if extra <= 0:
        return base
    if s == 0:
        w, s = [1] * n, n
    shares = [extra * x / s for x in w]
    alloc = [int(x) for x in shares]
    rest = extra - sum(alloc)
    order = sorted(range(n), key=lambda i: shares[i] - alloc[i], reverse=True)
    for i in order[:rest]:
        alloc[i] += 1
    return [b + a for b, a in zip(base, alloc)]


def request_metrics(res: RequestResult, t0: float, tokenizer, local_output_tokens: int | None = None) -> RequestMetrics:
    spec = res.spec
    m = RequestMetrics(
        index=res.index, request_id=res.request_id, server_request_id=res.server_request_id, warmup=res.warmup,
        ok=res.ok and (res.first_token_at is not None), status=res.status, error=res.error,
        lang=getattr(spec, "lang", "other"), business_type=getattr(spec, "business_type", None),
        user=getattr(spec, "user", None), intended=res.intended - t0, send_lag=max(0.0, res.sent - res.intended),
        ttfb=None if res.headers_at is None else res.headers_at - res.intended,
        ttft=None, e2e=None, tpot=None, decode=None, tail=None, max_tokens=getattr(spec, "max_tokens", 0),
        prompt_tokens_local=getattr(spec, "local_prompt_tokens", None),
        prompt_tokens_target=getattr(spec, "input_tokens", None), finish_reason=res.finish_reason,
        traffic_class=getattr(spec, "traffic_class", None),
    )
    if res.ok and res.first_token_at is None and res.error is None:
        m.error = "no content tokens in the response"
    usage = res.usage or {}
    if usage.get("prompt_tokens") is not None:
        m.prompt_tokens = int(usage["prompt_tokens"])
    n = len(res.chunk_times)
    m.chunks = n
    m.chunk_times = [t - t0 for t in res.chunk_times]
    if res.end is not None and res.first_token_at is not None:
        m.ttft = res.first_token_at - res.intended
        m.e2e = res.end - res.intended
        m.decode = res.chunk_times[-1] - res.chunk_times[0]
        m.tail = res.end - res.chunk_times[-1]
    # --- tokens per chunk
    if local_output_tokens is None:
        text = "".join(res.chunk_texts)
        local_output_tokens = len(tokenizer.encode(text)) if text else 0
    m.output_tokens_local = local_output_tokens
    total = usage.get("completion_tokens")
    cont = res.chunk_usage
    # A streamed answer's tokens cannot outnumber its text's bytes by much (a token is at least a byte of it, bar a
    # few special ones): a count past that is the server's error, and would make the bench allocate an ITL gap for
    # each claimed token. It is set aside for the bench's own count.
    if n and res.streamed:
        most = sum(len(t.encode("utf-8", "surrogatepass")) for t in res.chunk_texts) + n + 16
        if total is not None and int(total) > most:
            total = None
        if cont and cont[-1] is not None and int(cont[-1]) > most:
            cont = [None] * n
    # per-chunk recounts only where they are needed: no exact per-chunk usage, and more tokens than chunks
    need = n and not all(c is not None for c in cont) and (total is None or int(total) > n)
    recount = [len(tokenizer.encode(t)) for t in res.chunk_texts] if need else [1] * n
    if not res.streamed:
        # a whole answer at once: the client sees no token times, so no ITL, no TPOT and no "multi-token chunk"
        # (TTFT is the time to the whole answer, as in vLLM's bench without streaming)
        m.output_tokens = int(total) if total is not None else m.output_tokens_local
        m.output_tokens_source = "usage" if total is not None else "recount"
        m.chunk_tokens = []
        return m
    if n and all(c is not None for c in cont) and cont[-1] is not None:
        prev = 0
        counts = []
        for c in cont:
            counts.append(max(0, int(c) - prev))
            prev = int(c)
        m.chunk_tokens, m.output_tokens, m.output_tokens_source = counts, prev, "continuous_usage"
    elif total is not None and n:
        total = int(total)
        extra = total - n
        if extra == 1 and res.finish_reason == "stop" and max(recount, default=1) <= 1:
            # the stop token is counted by usage but never streamed: not a multi-token chunk
            m.chunk_tokens = [1] * n
        else:
            m.chunk_tokens = _distribute(total, recount, n) if extra > 0 else [1] * n
        m.output_tokens, m.output_tokens_source = total, "usage"
    elif n:
        m.chunk_tokens = [max(1, c) for c in recount]
        m.output_tokens, m.output_tokens_source = m.output_tokens_local, "recount"
    elif total is not None:
        m.output_tokens, m.output_tokens_source = int(total), "usage"
    m.multi_token_chunks = sum(1 for c in m.chunk_tokens if c > 1)
    # --- ITL: every gap, plus k-1 zero gaps for a chunk of k tokens
    if n and m.ok:
        ts = res.chunk_times
        itl = [b - a for a, b in zip(ts, ts[1:])]
        zeros = sum(c - 1 for c in m.chunk_tokens if c > 1)
        if zeros:
            itl.extend([0.0] * zeros)
        m.itl = itl
        if m.output_tokens and m.output_tokens > 1 and m.e2e is not None:
            m.tpot = (m.e2e - m.ttft) / (m.output_tokens - 1)
    return m


@dataclass
class Aggregates:
    measured: list[RequestMetrics]
    window: float
    summary: dict
    metrics: dict
    tokens: dict


def local_output_counts(results: list[RequestResult], tokenizer, batch: int = 512) -> list[int]:
    """The local token count of each response's text (batched: the Rust tokenizer encodes in parallel)."""
    texts = ["".join(r.chunk_texts) for r in results]
    out: list[int] = []
    for i in range(0, len(texts), batch):
        out.extend(len(ids) for ids in tokenizer.encode_batch(texts[i : i + batch]))
    return out


def aggregate(all_metrics: list[RequestMetrics], reps: int = 1000, seed: int = 0,
              failures_at: float | None = None, rate_window: float | None = None) -> Aggregates:
    """Run-wide figures. Percentiles are of completed requests only (as GuideLLM and AIPerf report them); every
    table says how many failed requests it leaves out (``excluded``). With ``failures_at`` (the request timeout,
    ``--failures-as-timeout``), each failed request enters TTFT and E2E at that value instead, in the tail where
    it belongs; ITL and TPOT have no value for a request that never finished, so they stay success-only.
    ``rate_window``: the span that rates are taken over (for one class of a run: the whole run's window)."""
    measured = [m for m in all_metrics if not m.warmup]
    ok = [m for m in measured if m.ok]
    errors = [m for m in measured if not m.ok]
    if measured:
        start = min(m.intended for m in measured)
        ends = [m.intended + (m.e2e if m.e2e is not None else 0.0) for m in measured]
        ends += [m.chunk_times[-1] for m in measured if m.chunk_times]
        window = max(max(ends) - start, 1e-9)
    else:
        window = float("nan")
    if rate_window is not None and measured:
        window = rate_window
    out_tok = sum(m.output_tokens or 0 for m in ok)
    in_tok = sum((m.prompt_tokens if m.prompt_tokens is not None else (m.prompt_tokens_local or 0)) for m in ok)
    summary = {
        "requests": {"sent": len(all_metrics), "warmup": len(all_metrics) - len(measured), "measured": len(measured),
                     "completed": len(ok), "failed": len(errors)},
        "duration_s": window,
        "error_rate": len(errors) / len(measured) if measured else None,
        "throughput": {
            "requests_per_s": len(ok) / window if measured else None,
            "output_tokens_per_s": out_tok / window if measured else None,
            "input_tokens_per_s": in_tok / window if measured else None,
            "total_tokens_per_s": (in_tok + out_tok) / window if measured else None,
        },
        "errors_by_kind": _error_kinds(errors),
    }
    itl_vals, itl_owner = [], []
    for m in ok:
        itl_vals.extend(m.itl)
        itl_owner.extend([m.index] * len(m.itl))
    filled = [failures_at] * len(errors) if failures_at is not None else []
    metrics = {
        "ttft": describe([m.ttft for m in ok] + filled, reps=reps, seed=seed),
        "itl": describe(itl_vals, itl_owner, reps=reps, seed=seed + 1),
        "tpot": describe([m.tpot for m in ok if m.tpot is not None], reps=reps, seed=seed + 2),
        "e2e": describe([m.e2e for m in ok] + filled, reps=reps, seed=seed + 3),
        "ttfb": describe([m.ttfb for m in ok if m.ttfb is not None], reps=0),
        "send_lag": describe([m.send_lag for m in measured], reps=0),
    }
    for name in ("ttft", "itl", "tpot", "e2e", "ttfb", "send_lag"):
        metrics[name]["unit"] = "s"
        at_timeout = name in ("ttft", "e2e") and failures_at is not None
        metrics[name]["excluded_failures"] = 0 if name == "send_lag" or at_timeout else len(errors)
        metrics[name]["failures_at_timeout"] = len(errors) if at_timeout else 0
    metrics["itl"]["note"] = "every gap between content chunks; a chunk of k tokens adds k-1 zero gaps"
    summary["percentile_failures"] = {
        "failed": len(errors),
        "policy": "success_only" if failures_at is None else "failures_at_timeout",
        "timeout_s": failures_at,
        "note": (f"{len(errors)} failed, cut-off or refused requests are left out of every percentile (each still "
                 "counts as an SLO miss in verdicts and goodput)" if failures_at is None else
                 f"{len(errors)} failed requests enter TTFT and E2E at the request timeout ({failures_at:g} s); "
                 "ITL and TPOT leave them out; each counts as an SLO miss in verdicts and goodput"),
    }
    return Aggregates(measured, window, summary, metrics, token_report(ok))


def _error_kinds(errors: list[RequestMetrics]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for m in errors:
        key = (m.error or f"HTTP {m.status}").split(":")[0][:60]
        kinds[key] = kinds.get(key, 0) + 1
    return kinds


def token_report(ok: list[RequestMetrics]) -> dict:
    sources: dict[str, int] = {}
    for m in ok:
        sources[m.output_tokens_source] = sources.get(m.output_tokens_source, 0) + 1
    both = [(m.output_tokens, m.output_tokens_local) for m in ok
            if m.output_tokens_source in ("usage", "continuous_usage") and m.output_tokens and m.output_tokens_local]
    drift = None
    if both:
        rel = np.array([(loc - srv) / srv for srv, loc in both])
        drift = {"requests": len(both), "mean_rel": float(rel.mean()), "p50_rel": float(np.median(rel)),
                 "max_abs_rel": float(np.abs(rel).max()),
                 "note": "local recount minus server usage, relative; a tokenizer other than the server's drifts"}
    missing = sum(1 for m in ok if m.output_tokens_source == "recount")
    chunks = sum(m.chunks for m in ok)
    multi = sum(m.multi_token_chunks for m in ok)
    sizes = [c for m in ok for c in m.chunk_tokens]
    pdrift = [((m.prompt_tokens_local or 0) - m.prompt_tokens) / m.prompt_tokens for m in ok
              if m.prompt_tokens and m.prompt_tokens_local]
    fixed = [m for m in ok if m.max_tokens]
    short = [m for m in fixed if m.output_tokens is not None and m.output_tokens < m.max_tokens]
    return {
        "output_tokens_source": sources,
        "usage_missing_requests": missing,
        "recount_vs_usage_drift": drift,
        "prompt_tokens": {
            "server_total": sum(m.prompt_tokens or 0 for m in ok),
            "local_total": sum(m.prompt_tokens_local or 0 for m in ok),
            "target_total": sum(m.prompt_tokens_target or 0 for m in ok),
            "local_vs_server_rel_p50": float(np.median(pdrift)) if pdrift else None,
            "note": "the server's usage includes its chat template; the local count is of the prompt text only",
        },
        "output_tokens_total": sum(m.output_tokens or 0 for m in ok),
        "chunks": {"total": chunks, "multi_token": multi, "multi_token_share": multi / chunks if chunks else None,
                   "max_tokens_per_chunk": max(sizes, default=0),
                   "requests_with_multi_token_chunks": sum(1 for m in ok if m.multi_token_chunks)},
        "fixed_output": {"requests": len(fixed), "shorter_than_max_tokens": len(short),
                         "share_shorter": len(short) / len(fixed) if fixed else None},
    }
