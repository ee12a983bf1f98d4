"""``tailguard rebuild REQUEST_ID``: run a stored request's computation again on the embedded engine, by its id.

A server started with a sealing key (``--seal-key-file``) keeps, for each request, its token ids (the prompt after
the chat template, and the answer), its whole sampling parameters and the random seed it ran with, encrypted
(observe/sealing.py). The rebuild opens them with the same key and runs the request alone on an engine in this
process, step by step, with the same token ids, parameters and seed, and shows:

- its step timeline: each engine step's time, the prompt tokens it computed (chunked prefill) or the token it
  decoded, beside the original's token times from the record;
- the batch it shared: the requests whose engine time overlapped the original's, from the store (their ids, lanes,
  sizes), which is what the original ran beside and the rebuild does not;
- sampled internals (per-layer timings and activation statistics) when ``--internals`` is given (the torch runner
  takes the steps then, as it does for sampled requests in a server);
- every output token that differs from the original's, with the first position, both tokens and their text.

An answer that differs is a finding, not an error: the original ran in a batch, and a batch changes the order of
floating-point sums; a seeded request otherwise draws the same tokens. The engine's flags must be the server's
(``--weight-format``, ``--kv-cache-dtype``, ``--runner``): the report says which engine ran the rebuild.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tailguard.observe.sealing import SealError, TokenSeal, sampling_from_json
from tailguard.output_path import unwritable

# How far before a request's arrival another one may have arrived and still shared its batch (the longest request
# a server keeps is far shorter).
OVERLAP_LOOKBACK_S = 600.0
MAX_SHARED = 2000


class RebuildError(Exception):
    pass


@dataclass
class Step:
    index: int
    seconds: float  # the engine step's own time
    computed: int  # the request's tokens this step computed (a prompt chunk, or 1 for a decode)
    batch: int  # sequences running in the step
    token: int | None  # the token it produced, if any


@dataclass
class Rebuilt:
    request_id: str
    engine: str  # the rebuild's engine, in words
    prompt_tokens: int
    sampling: dict[str, Any]
    seed_given: bool
    original_ids: list[int]
    rebuilt_ids: list[int]
    steps: list[Step]
    original_token_times: list[float]  # seconds after arrival, from the record
    rebuilt_token_times: list[float]  # seconds after the rebuild's first step began
    shared: list[dict[str, Any]] = field(default_factory=list)
    internals: dict[str, Any] | None = None
    differences: list[dict[str, Any]] = field(default_factory=list)

    @property
    def first_difference(self) -> int | None:
        return self.differences[0]["position"] if self.differences else None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["first_difference"] = self.first_difference
        out["same_output"] = not self.differences
        return out


def fetch(request_id: str, store: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The record, and the records whose engine time overlapped it (the batch it shared), from a store."""
    from tailguard.observe.stores import open_store

    try:
        st = open_store(store, read_only=True)
    except (OSError, RuntimeError, ValueError) as exc:  # not there, not a store, unreachable, a newer schema
        raise RebuildError(f"cannot read the store: {_hide_password(str(exc), store)}") from None
    try:
        rec = st.get(request_id)
        if rec is None:
            raise RebuildError(f"no record of request {request_id!r} in {_describe(store)}")
        return rec, _overlapping(st, rec)
    finally:
        st.close()


def _describe(store: str) -> str:
    """The store target fit to print: a PostgreSQL URL's password masked."""
    from tailguard.observe.stores import describe_store_target

    return describe_store_target(store)


def _hide_password(text: str, store: str) -> str:
    """``text`` with the store URL's password masked wherever it appears (a driver's message may quote the URL)."""
    from urllib.parse import unquote, urlsplit

    text = text.replace(store, _describe(store))
    try:
        password = urlsplit(store).password
    except ValueError:  # not a URL at all: a file path has no password
        return text
    for secret in {password, unquote(password)} if password else ():
        if secret:
            text = text.replace(secret, "***")
    return text


def _window(rec: dict[str, Any]) -> tuple[float, float] | None:
    """The record's engine time (first scheduled to last token) in unix seconds."""
    ts = rec.get("timestamps") or {}
    start, end = ts.get("scheduled"), ts.get("last_token")
    if start is None or end is None:
        return None
    return rec["received_at"] + start, rec["received_at"] + end


def _overlapping(st: Any, rec: dict[str, Any]) -> list[dict[str, Any]]:
    from tailguard.observe.store import row_to_record

    mine = _window(rec)
    if mine is None:
        return []
    # One query for the candidates' whole rows (not one more per candidate).
    rows = st.query("SELECT * FROM requests WHERE received_at BETWEEN ? AND ? AND request_id <> ? "
                    "ORDER BY received_at LIMIT ?",
                    (rec["received_at"] - OVERLAP_LOOKBACK_S, mine[1], rec["request_id"], MAX_SHARED))
    shared = []
    for row in rows:
        other = row_to_record(row)
        win = _window(other)
        if win is None or win[1] < mine[0] or win[0] > mine[1]:
            continue
        overlap = min(win[1], mine[1]) - max(win[0], mine[0])
        shared.append({"request_id": other["request_id"], "lane": other.get("lane"),
                       "prompt_tokens": other.get("prompt_tokens"), "output_tokens": other.get("output_tokens"),
                       "overlap_s": round(overlap, 6), "started_s": round(win[0] - mine[0], 6)})
    return shared


def open_sealed(rec: dict[str, Any], key: str) -> dict[str, Any]:
    sealed = rec.get("sealed")
    if not sealed:
        raise RebuildError(f"request {rec['request_id']} has no sealed tokens: its server ran without a sealing key "
                           "(--seal-key-file), or it never reached the engine")
    try:
        return TokenSeal(key).open(sealed)
    except SealError as exc:
        raise RebuildError(str(exc)) from None


def run(rec: dict[str, Any], payload: dict[str, Any], engine: Any, shared: list[dict[str, Any]] | None = None,
        text: Any = None) -> Rebuilt:
    """Run the request alone on ``engine`` (an ``LLMEngine``), one step at a time."""
    sampling = sampling_from_json(payload["sampling"])
    prompt = list(payload["prompt_ids"])
    rid = engine.add_request(prompt, sampling, request_id=f"rebuild-{rec['request_id']}")
    seq = engine._tracked[rid].seq  # read-only: how far its prompt is computed after each step
    steps: list[Step] = []
    times: list[float] = []
    internals = None
    began = time.perf_counter()
    while engine.has_unfinished():
        before = seq.num_computed_tokens
        batch = engine.stats().running
        t0 = time.perf_counter()
        events = engine.step()
        dt = time.perf_counter() - t0
        token = None
        for ev in events:
            if ev.request_id != rid:
                continue
            if ev.token_id is not None:
                token = ev.token_id
                times.append(time.perf_counter() - began)
            if ev.finished:
                internals = ev.internals
        steps.append(Step(len(steps), dt, max(1 if token is not None else 0, seq.num_computed_tokens - before),
                          batch, token))
    rebuilt = list(seq.output_token_ids)
    original = list(payload.get("output_ids") or [])
    diffs = []
    for i in range(max(len(original), len(rebuilt))):
        a = original[i] if i < len(original) else None
        b = rebuilt[i] if i < len(rebuilt) else None
        if a != b:
            diffs.append({"position": i, "original": a, "rebuilt": b,
                          **({"original_text": text([a]) if a is not None else None,
                              "rebuilt_text": text([b]) if b is not None else None} if text is not None else {})})
    ts = rec.get("token_times") or []
    return Rebuilt(
        request_id=rec["request_id"], engine=engine.describe(), prompt_tokens=len(prompt),
        sampling=payload["sampling"], seed_given=bool(payload.get("seed_given")), original_ids=original,
        rebuilt_ids=rebuilt, steps=steps, original_token_times=list(ts), rebuilt_token_times=times,
        shared=shared or [], internals=internals, differences=diffs)


def render(r: Rebuilt, console: Any = None) -> None:
    """The rebuild as a person reads it in a terminal."""
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    con.print(f"[bold]Rebuild of {r.request_id}[/bold]  ({r.engine})")
    seed = r.sampling.get("seed")
    con.print(f"prompt {r.prompt_tokens} tokens; sampling: temperature {r.sampling.get('temperature')}, "
              f"top_p {r.sampling.get('top_p')}, max_tokens {r.sampling.get('max_tokens')}, seed {seed}"
              f"{'' if r.seed_given else ' (given by the server)'}")
    if r.differences:
        d = r.differences[0]
        con.print(f"[yellow]output differs[/yellow] at {len(r.differences)} of {len(r.rebuilt_ids)} positions, first "
                  f"at token {d['position']}: original {d['original']} {d.get('original_text', '')!r}, rebuilt "
                  f"{d['rebuilt']} {d.get('rebuilt_text', '')!r}")
    else:
        con.print(f"[green]same output[/green]: all {len(r.rebuilt_ids)} tokens equal the original's")
    prefill = [s for s in r.steps if s.computed > 1 or (s.token is None and s.computed)]
    t = Table(title="step timeline (the rebuild, alone)")
    for col in ("steps", "what", "tokens", "time"):
        t.add_column(col, justify="right" if col != "what" else "left")
    t.add_row(str(len(prefill)), "prompt chunks", str(sum(s.computed for s in prefill)),
              f"{sum(s.seconds for s in prefill) * 1e3:.1f} ms")
    decode = [s for s in r.steps if s not in prefill]
    t.add_row(str(len(decode)), "decode steps", str(len(decode)), f"{sum(s.seconds for s in decode) * 1e3:.1f} ms")
    con.print(t)
    orig = r.original_token_times
    if orig and r.rebuilt_token_times:
        con.print(f"first token: original {orig[0] * 1e3:.0f} ms after arrival (queue and batch included), rebuilt "
                  f"{r.rebuilt_token_times[0] * 1e3:.0f} ms after its first step; last token: original "
                  f"{orig[-1] * 1e3:.0f} ms, rebuilt {r.rebuilt_token_times[-1] * 1e3:.0f} ms")
    if r.shared:
        busiest = sorted(r.shared, key=lambda s: -s["overlap_s"])[:10]
        t = Table(title=f"the batch it shared: {len(r.shared)} requests overlapped its engine time")
        for col in ("request", "lane", "prompt", "output", "overlap"):
            t.add_column(col, justify="left" if col in ("request", "lane") else "right")
        for s in busiest:
            t.add_row(str(s["request_id"]), str(s["lane"]), str(s["prompt_tokens"]), str(s["output_tokens"]),
                      f"{s['overlap_s'] * 1e3:.0f} ms")
        con.print(t)
    else:
        con.print("the batch it shared: no other request overlapped its engine time")
    if r.internals is not None:
        con.print(f"sampled internals: {len(r.internals.get('steps', []))} steps recorded (see --json)")


def write_html(r: Rebuilt, path: str | Path) -> Path:
    """The step timeline and token times, original against rebuilt, as an HTML page with plotly figures."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=2, cols=1, subplot_titles=("tokens over time: original (in its batch) and rebuilt "
                                                        "(alone)", "the rebuild's steps"), vertical_spacing=0.15)
    fig.add_trace(go.Scatter(x=[t * 1e3 for t in r.original_token_times],
                             y=list(range(1, len(r.original_token_times) + 1)), name="original", mode="lines+markers"),
                  row=1, col=1)
    fig.add_trace(go.Scatter(x=[t * 1e3 for t in r.rebuilt_token_times],
                             y=list(range(1, len(r.rebuilt_token_times) + 1)), name="rebuilt", mode="lines+markers"),
                  row=1, col=1)
    for pos in [d["position"] for d in r.differences][:50]:
        if pos < len(r.rebuilt_token_times):
            fig.add_vline(x=r.rebuilt_token_times[pos] * 1e3, line_dash="dot", line_color="red", row=1, col=1)
    fig.add_trace(go.Bar(x=[s.index for s in r.steps], y=[s.seconds * 1e3 for s in r.steps], name="step time",
                         text=[f"{s.computed} tokens" for s in r.steps]), row=2, col=1)
    fig.update_xaxes(title_text="ms", row=1, col=1)
    fig.update_yaxes(title_text="tokens", row=1, col=1)
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_yaxes(title_text="ms", row=2, col=1)
    fig.update_layout(height=800, title=f"Rebuild of {r.request_id}: "
                      + ("same output" if not r.differences else
                         f"{len(r.differences)} tokens differ, first at {r.first_difference}"))
    out = Path(path)
    try:
        out.write_text(fig.to_html(include_plotlyjs=True, full_html=True))
    except OSError as exc:
        raise RebuildError(f"cannot write {path}: {exc.strerror or exc}") from None
    return out


def check_writable(path: str | Path) -> None:
    """Fail now, not after the whole rebuild, when ``path`` cannot be written."""
    why = unwritable(path)
    if why is not None:
        raise RebuildError(f"cannot write {path}: {why}")


def main(request_id: str, store: str, key_file: str | None, engine_args: Any, internals: bool = False,
         as_json: bool = False, html: str | None = None) -> int:
    from tailguard.engine.engine import LLMEngine
    from tailguard.observe.sealing import load_key

    key = load_key(key_file)
    if key is None:
        raise RebuildError("a sealing key is needed: --seal-key-file, or TAILGUARD_SEAL_KEY")
    if html:
        check_writable(html)
    rec, shared = fetch(request_id, store)
    payload = open_sealed(rec, key)
    if internals:  # every step of this request sampled
        engine_args.internals_sample_rate = 1.0
        engine_args.internals_decode_every = 1
        engine_args.internals_seed = 0
    engine = LLMEngine(engine_args)
    r = run(rec, payload, engine, shared, text=lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=False))
    if as_json:
        print(json.dumps(r.to_json(), indent=1))
    else:
        render(r)
    if html:
        print(f"wrote {write_html(r, html)}")
    return 0
