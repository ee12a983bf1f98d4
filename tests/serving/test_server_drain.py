"""The drain on SIGTERM (serving/drain.py), against ``tailguard serve`` as a supervisor runs it: ``/ready`` says 503
first, queued requests get a JSON 503 with Retry-After at once, running streams finish or end with an error event and
``[DONE]``, and each request's record in the store says what its client saw."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from tests.serving_helpers import ADMIN_KEY, start_serve, wait_until


@dataclass
class Seen:
    """What one client saw."""

    rid: str
    stream: bool
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: str = ""
    events: list[str] = field(default_factory=list)
    first_token_at: float | None = None
    done_at: float | None = None
    error: str | None = None

    def content_tokens(self) -> int:
        n = 0
        for e in self.events:
            if e.startswith("{") and '"choices"' in e:
                delta = json.loads(e)["choices"][0].get("delta", {})
                n += len(delta.get("content") or "")  # the fake engine's tokens are one character each
        return n


def _client(url: str, seen: Seen, max_tokens: int) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "stream": seen.stream}
    try:
        with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/chat/completions", json=body,
                                                     headers={"X-Request-ID": seen.rid}) as r:
            seen.status, seen.headers = r.status_code, dict(r.headers)
            if seen.stream and r.status_code == 200:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        seen.events.append(line[6:])
                        if seen.first_token_at is None and '"content":"' in line and '"content":""' not in line:
                            seen.first_token_at = time.monotonic()
            else:
                seen.body = r.read().decode()
    except httpx.HTTPError as exc:
        seen.error = repr(exc)
    seen.done_at = time.monotonic()


def _serve(tmp: Path, drain_s: float) -> tuple[subprocess.Popen, str, Path]:
    store = tmp / "requests.sqlite3"
    cfg = tmp / "server.yaml"
    cfg.write_text(yaml.safe_dump({"fake": {"ttft": 0.05, "itl": 0.05, "max_num_seqs": 3},
                                   "graceful_shutdown_s": drain_s, "admin_key": ADMIN_KEY, "log_level": "warning",
                                   "access_log": False}))
    proc, url = start_serve("--model", "fake", "--config", str(cfg), "--store", str(store))
    return proc, url, store


def _start(url: str, seen: list[Seen], max_tokens: int) -> list[threading.Thread]:
    threads = [threading.Thread(target=_client, args=(url, s, max_tokens), daemon=True) for s in seen]
    for t in threads:
        t.start()
    return threads


def _records(store: Path) -> dict[str, sqlite3.Row]:
    db = sqlite3.connect(store)
    db.row_factory = sqlite3.Row
    rows = {r["request_id"]: r for r in db.execute("SELECT * FROM requests")}
    db.close()
    return rows


def _sigterm_with_queue(tmp: Path, drain_s: float, max_tokens: int):
    """3 running streams (the fake engine's 3 slots), then 3 queued streams and 2 queued plain requests; SIGTERM.
    Returns the clients, the process, the store, when SIGTERM went, and what /ready, /health and a new request got
    during the drain."""
    proc, url, store = _serve(tmp, drain_s)
    try:
        running = [Seen(f"run-{i}", True) for i in range(3)]
        threads = _start(url, running, max_tokens)
        assert wait_until(lambda: all(s.first_token_at for s in running), timeout=20)
        queued = [Seen(f"queued-stream-{i}", True) for i in range(3)] + [Seen(f"queued-full-{i}", False)
                                                                         for i in range(2)]
        threads += _start(url, queued, max_tokens)
        time.sleep(0.5)  # admitted, waiting for an engine slot
        assert all(s.status is None for s in queued) and all(s.done_at is None for s in running)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        with httpx.Client(timeout=5) as c:
            assert wait_until(lambda: c.get(url + "/ready").status_code == 503, timeout=5, interval=0.02)
            ready_at = time.monotonic()
            ready = c.get(url + "/ready")
            health = c.get(url + "/health")
            late = c.post(url + "/v1/chat/completions", headers={"X-Request-ID": "late-1"},
                          json={"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        for t in threads:
            t.join(60)
        out, _ = proc.communicate(timeout=60)
        exited = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode in (0, -signal.SIGTERM), out
    return running, queued, store, sent, exited, ready_at, (ready, health, late)


def _assert_refused_at_once(queued: list[Seen], sent: float) -> None:
    for s in queued:
        assert s.error is None, s
        assert s.status == 503, s
        assert s.headers.get("retry-after") == "5" and s.headers["content-type"].startswith("application/json")
        err = json.loads(s.body)["error"]
        assert err["code"] == "server_shutting_down" and err["type"] == "service_unavailable"
        assert s.done_at - sent < 1.5, "a queued request must be answered at once, not after the drain"


def _assert_drain_surfaces(ready_at: float, sent: float, probes) -> None:
    ready, health, late = probes
    assert ready_at - sent < 1.0
    assert ready.status_code == 503 and ready.json()["status"] == "draining"
    assert health.status_code == 200
    assert late.status_code == 503 and late.headers["retry-after"] == "5"
    assert late.json()["error"]["code"] == "server_shutting_down"


def test_sigterm_answers_the_queue_at_once_and_cuts_streams_cleanly_after_the_drain_timeout(tmp_path):
    running, queued, store, sent, exited, ready_at, probes = _sigterm_with_queue(tmp_path, 1.5, max_tokens=1000)
    _assert_drain_surfaces(ready_at, sent, probes)
    _assert_refused_at_once(queued, sent)
    for s in running:
        assert s.error is None and s.status == 200, s
        # Ended cleanly: an OpenAI error event, then [DONE]; after the drain timeout, not before.
        assert s.events[-1] == "[DONE]", s.events[-3:]
        err = json.loads(s.events[-2])["error"]
        assert err["code"] == "server_shutting_down" and "drain timeout" in err["message"]
        assert 1.3 < s.done_at - sent < 6
    assert exited - sent < 15
    rec = _records(store)
    for s in queued:
        r = rec[s.rid]
        assert (r["status"], r["outcome"], r["output_tokens"]) == (503, "rejected", 0)
        assert r["error"] == json.loads(s.body)["error"]["message"]
    for s in running:
        r = rec[s.rid]
        assert (r["status"], r["outcome"]) == (503, "error")
        assert r["error"] == json.loads(s.events[-2])["error"]["message"]
        assert r["output_tokens"] == s.content_tokens() > 0  # what the client received, not more
    assert (rec["late-1"]["status"], rec["late-1"]["outcome"]) == (503, "rejected")


def test_sigterm_lets_running_streams_finish_within_the_drain_timeout_then_exits(tmp_path):
    running, queued, store, sent, exited, ready_at, probes = _sigterm_with_queue(tmp_path, 20, max_tokens=40)
    _assert_drain_surfaces(ready_at, sent, probes)
    _assert_refused_at_once(queued, sent)
    for s in running:
        assert s.error is None and s.status == 200, s
        assert s.events[-1] == "[DONE]" and json.loads(s.events[-2])["choices"][0]["finish_reason"] == "length"
        assert s.content_tokens() == 40
    # The process left as soon as the last stream ended, not at the drain timeout.
    assert exited - sent < 10
    rec = _records(store)
    for s in running:
        assert (rec[s.rid]["status"], rec[s.rid]["outcome"], rec[s.rid]["output_tokens"]) == (200, "success", 40)
    for s in queued:
        assert (rec[s.rid]["status"], rec[s.rid]["outcome"]) == (503, "rejected")
