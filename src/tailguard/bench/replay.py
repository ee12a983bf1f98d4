"""``tailguard replay REQUEST_ID --url URL``: send a stored request again, to any OpenAI-compatible endpoint (T4).

The record comes from a tailguard server (``--source URL`` with the admin key) or straight from a request store
(``--store PATH_OR_URL``). It must hold the prompt, which tailguard keeps only with ``--store-text`` (redacted): a
prompt whose redaction changed it is replayed as stored, and the report says so. Chat requests were stored as the text
their chat template rendered, so they are replayed through ``/v1/completions`` with that text (the same tokens for the
same model); the sampling parameters are the original's (``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
``seed``, ``ignore_eos``, ``min_tokens``; stop strings when they were kept). The report puts the original's stage
timings beside the replay's (client-side TTFT and E2E, and the server's own stages when the target is tailguard), and
the edit distance between the two outputs in words (and characters).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from rapidfuzz.distance import Levenshtein

from tailguard.bench.redact import redact_url
from tailguard.observe.store import first_line
from tailguard.observe.stores import describe_store_target


class ReplayError(Exception):
    pass


def fetch_record(request_id: str, source: str | None = None, store: str | None = None,
                 admin_key: str | None = None) -> dict[str, Any]:
    if store:
        from tailguard.observe.stores import open_store

        try:
            st = open_store(store, read_only=True)
            try:
                rec = st.get(request_id)
            finally:
                st.close()
        except (OSError, RuntimeError, ValueError) as exc:  # not there, not a store, unreachable, a newer schema
            raise ReplayError(f"cannot read the store: {first_line(exc)}") from exc
        if rec is None:
            raise ReplayError(f"no record of request {request_id!r} in {describe_store_target(store)}")
        return rec
    if not source:
        raise ReplayError("say where the record is: --source URL (a tailguard server) or --store PATH_OR_URL")
    key = admin_key or os.environ.get("TAILGUARD_ADMIN_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.get(f"{source.rstrip('/')}/v1/requests/{request_id}", headers=headers, timeout=30, trust_env=False)
    except httpx.HTTPError as exc:
        raise ReplayError(f"{redact_url(source)}: {type(exc).__name__}: {first_line(exc)}") from exc
    if r.status_code != 200:
        try:
            msg = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = r.text[:200]
        raise ReplayError(f"{redact_url(source)} answered {r.status_code} for request {request_id!r}: {msg}")
    try:
        rec = r.json()
    except ValueError as exc:
        raise ReplayError(f"{redact_url(source)} answered with something that is not JSON for request "
                          f"{request_id!r}") from exc
    if not isinstance(rec, dict) or "request_id" not in rec:
        raise ReplayError(f"{redact_url(source)} answered with something that is not a request record")
    return rec


def build_request(rec: dict[str, Any], model: str) -> tuple[str, dict[str, Any], list[str]]:
    """The endpoint path, the body to send and the notes on what differs from the original."""
    notes: list[str] = []
    prompt = rec.get("prompt_text")
    if prompt is None:
        raise ReplayError(f"request {rec.get('request_id')!r} has no stored prompt: tailguard keeps prompts only "
                          "when the server runs with --store-text")
    if rec.get("prompt_redacted"):
        notes.append("the stored prompt was redacted (personal data replaced): it is replayed as stored, so the "
                     "answer may differ for that reason alone")
    s = rec.get("sampling") or {}
    body: dict[str, Any] = {"model": model, "prompt": prompt, "stream": True,
                            "stream_options": {"include_usage": True}}
    for k in ("max_tokens", "temperature", "top_p", "seed", "min_tokens"):
        if s.get(k) is not None:
            body[k] = s[k]
    if s.get("top_k"):
        body["top_k"] = s["top_k"]
    if s.get("ignore_eos"):
        body["ignore_eos"] = True
    if s.get("stop"):
        body["stop"] = s["stop"]
    elif s.get("stop_count"):
        notes.append(f"the original had {s['stop_count']} stop sequence(s), not stored: replayed without them")
    if rec.get("endpoint") == "/v1/chat/completions":
        notes.append("a chat request, replayed as its rendered chat template through /v1/completions")
    return "/v1/completions", body, notes


@dataclass
class ReplayResult:
    request_id: str
    url: str
    notes: list[str]
    status: int = 0
    text: str = ""
    ttft: float | None = None
    e2e: float = 0.0
    output_tokens: int | None = None
    server_stages: dict[str, float] | None = None
    original: dict[str, Any] = field(default_factory=dict)

    def distance(self) -> dict[str, Any]:
        orig = self.original.get("output_text")
        if orig is None:
            return {"words": None, "chars": None, "note": "the original output was not stored"}
        return {"words": Levenshtein.distance(orig.split(), self.text.split()),
                "chars": Levenshtein.distance(orig, self.text), "identical": orig == self.text}

    def to_dict(self) -> dict[str, Any]:
        o = self.original
        return {
            "request_id": self.request_id, "url": self.url, "status": self.status, "notes": self.notes,
            "edit_distance": self.distance(),
            "original": {"ttft": o.get("ttft"), "e2e": o.get("e2e"), "stages": o.get("stages"),
                         "output_tokens": o.get("output_tokens")},
            "replay": {"ttft": self.ttft, "e2e": self.e2e, "stages": self.server_stages,
                       "output_tokens": self.output_tokens},
            "text": self.text,
        }


def replay(rec: dict[str, Any], url: str, model: str | None = None, api_key: str | None = None,
           timeout: float = 300.0) -> ReplayResult:
    """Send the record's request to ``url`` and time its answer; ReplayError when it cannot (unreachable, refused,
    an answer that is not an event stream of JSON)."""
    try:
        return _replay(rec, url, model, api_key, timeout)
    except httpx.HTTPError as exc:
        raise ReplayError(f"{redact_url(url)}: {type(exc).__name__}: {first_line(exc)}") from exc
    except (ValueError, AttributeError, TypeError) as exc:
        raise ReplayError(f"{redact_url(url)} answered with a stream tailguard cannot read: {first_line(exc)}") \
            from exc



def _replay(rec: dict[str, Any], url: str, model: str | None, api_key: str | None, timeout: float) -> ReplayResult:
    base = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=timeout, trust_env=False, headers=headers) as client:
        if model is None:
            try:
                model = client.get(base + "/v1/models").json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError):
                model = rec.get("model") or "default"
        path, body, notes = build_request(rec, model)
        res = ReplayResult(rec["request_id"], redact_url(base + path), notes, original=rec)
        t0 = time.perf_counter()
        with client.stream("POST", base + path, json=body,
                           headers={"X-Request-ID": f"replay-{rec['request_id']}"[:128]}) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                resp.read()
                raise ReplayError(f"{redact_url(base + path)} answered {resp.status_code}: {resp.text[:300]}")
            parts: list[str] = []
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("error"):
                    raise ReplayError(f"the replay failed mid-stream: {obj['error']}")
                for ch in obj.get("choices") or ():
                    if ch.get("text"):
                        if res.ttft is None:
                            res.ttft = time.perf_counter() - t0
                        parts.append(ch["text"])
                if obj.get("usage"):
                    res.output_tokens = obj["usage"].get("completion_tokens")
                if isinstance(obj.get("tailguard"), dict):  # a tailguard target says where its time went
                    res.server_stages = obj["tailguard"].get("stages")
        res.e2e = time.perf_counter() - t0
        res.text = "".join(parts)
    return res


def render(res: ReplayResult) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    d = res.to_dict()
    con.print(f"[bold]replay[/] of {res.request_id} -> {res.url}")
    for n in res.notes:
        con.print(f"[yellow]note:[/] {n}")
    t = Table(title="where the time went (seconds)", title_justify="left")
    for c in ("", "original", "replay"):
        t.add_column(c, justify="left" if not c else "right")
    o, r = d["original"], d["replay"]

    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.3f}"

    t.add_row("TTFT", f(o["ttft"]), f(r["ttft"]) + " (client)")
    for stage in ("tokenize", "queue", "prefill", "decode", "stream"):
        t.add_row(stage, f((o["stages"] or {}).get(stage)), f((r["stages"] or {}).get(stage)))
    t.add_row("E2E", f(o["e2e"]), f(r["e2e"]) + " (client)")
    t.add_row("output tokens", str(o["output_tokens"]), str(r["output_tokens"]))
    con.print(t)
    dist = d["edit_distance"]
    if dist.get("words") is None:
        con.print(f"edit distance: - ({dist['note']})")
    else:
        con.print(f"edit distance to the original output: {dist['words']} words, {dist['chars']} characters"
                  + (" (identical)" if dist["identical"] else ""))
