"""Who may read what: records, alerts and SLO data are admin surfaces; a client key reads only its own records."""

from __future__ import annotations

import sqlite3

import httpx
import pytest

from tailguard.engine.fake import FakeEngine, FakeTiming
from tailguard.serving.config import ServerConfig
from tests.serving_helpers import ADMIN_KEY, fake_server, settle

BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
ADMIN_SURFACES = ("/v1/alerts", "/slo/data")


def _chat(server, rid: str, key: str | None) -> httpx.Response:
    headers = {"X-Request-ID": rid, **({"Authorization": f"Bearer {key}"} if key else {})}
    r = httpx.post(server.url + "/v1/chat/completions", json=BODY, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r


def _get(server, path: str, key: str | None = None) -> httpx.Response:
    return httpx.get(server.url + path, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)


def _assert_error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"] in ("authentication_error", "permission_error")


@pytest.mark.parametrize("client_key", [None, "client-key"])
def test_without_an_admin_key_the_admin_surfaces_are_closed(tmp_path, client_key):
    with fake_server(tmp_path, admin_key=None, api_key=client_key) as s:
        _chat(s, "open-1", client_key)
        settle(s)
        for path in ADMIN_SURFACES:
            _assert_error(_get(s, path), 403, "admin_key_not_configured")
            _assert_error(_get(s, path, client_key or "anything"), 403, "admin_key_not_configured")
        if client_key is None:
            # No key at all: nobody can read a record, not even by its (guessable) id.
            _assert_error(_get(s, "/v1/requests/open-1"), 403, "admin_key_not_configured")
        else:
            _assert_error(_get(s, "/v1/requests/open-1"), 401, "invalid_api_key")
            assert _get(s, "/v1/requests/open-1", client_key).json()["request_id"] == "open-1"


def test_admin_key_reads_everything_and_a_client_key_only_its_own_records(tmp_path):
    keys = ["key-of-alice", "key-of-bob"]
    with fake_server(tmp_path, api_key=keys[0], api_keys=[keys[1]]) as s:
        _chat(s, "alice-1", keys[0])
        _chat(s, "bob-1", keys[1])
        _chat(s, "admin-1", ADMIN_KEY)
        settle(s)
        for path in ADMIN_SURFACES:
            assert _get(s, path, ADMIN_KEY).status_code == 200
            _assert_error(_get(s, path, keys[0]), 403, "admin_only")
            _assert_error(_get(s, path, "wrong"), 401, "invalid_api_key")
            _assert_error(_get(s, path), 401, "invalid_api_key")
        for rid in ("alice-1", "bob-1", "admin-1"):
            assert _get(s, f"/v1/requests/{rid}", ADMIN_KEY).json()["request_id"] == rid
        assert _get(s, "/v1/requests/alice-1", keys[0]).json()["outcome"] == "success"
        assert _get(s, "/v1/requests/bob-1", keys[1]).json()["outcome"] == "success"
        # Another client's record, or the admin's, is "not found": a client learns nothing of them.
        for key, rid in ((keys[0], "bob-1"), (keys[1], "alice-1"), (keys[0], "admin-1")):
            r = _get(s, f"/v1/requests/{rid}", key)
            assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found"
        _assert_error(_get(s, "/v1/requests/alice-1"), 401, "invalid_api_key")
        owners = {rid: _get(s, f"/v1/requests/{rid}", ADMIN_KEY).json()["owner"] for rid in ("alice-1", "bob-1")}
        assert owners["alice-1"] != owners["bob-1"]
        # The same ID reused by another client: each sees its own record, the newest of its own.
        _chat(s, "alice-1", keys[1])
        settle(s)
        assert _get(s, "/v1/requests/alice-1", keys[0]).json()["owner"] == owners["alice-1"]
        assert _get(s, "/v1/requests/alice-1", keys[1]).json()["owner"] == owners["bob-1"]
        path = s.config.store_path
    # The record knows its client by a hash: no key is stored in clear.
    raw = b"".join(bytes(str(row), "utf-8") for row in sqlite3.connect(path).execute("SELECT * FROM requests"))
    assert raw and all(k.encode() not in raw for k in (*keys, ADMIN_KEY))


def test_the_admin_key_must_differ_from_the_client_keys(monkeypatch):
    with pytest.raises(ValueError, match="admin_key must differ"):
        ServerConfig(api_key="same", admin_key="same")
    with pytest.raises(ValueError, match="admin_key must differ"):
        ServerConfig(api_key="a", api_keys=["same"], admin_key="same")
    monkeypatch.setenv("TAILGUARD_ADMIN_KEY", "from-env")
    assert ServerConfig.load().admin_key.get_secret_value() == "from-env"
    assert ServerConfig.load(admin_key="flag").admin_key.get_secret_value() == "flag"



def test_serve_takes_the_admin_key_flag(capsys):
    from tailguard.cli import main

    assert main(["serve", "--model", "fake", "--api-key", "same", "--admin-key", "same"]) == 2
    err = capsys.readouterr().err
    assert "admin_key must differ" in err and "same" not in err.replace("admin_key must differ", "")


class _PriorityEngine(FakeEngine):
    """The fake engine, remembering the priority each request was handed to it with."""

    def __init__(self) -> None:
        super().__init__(FakeTiming(ttft=0.001, itl=0.001))
        self.priorities: list[int] = []

    async def generate(self, prompt_token_ids, sampling, request_id, priority=0, arrival_time=None):
        self.priorities.append(priority)
        async for ev in super().generate(prompt_token_ids, sampling, request_id, priority, arrival_time):
            yield ev


@pytest.mark.parametrize("trusted", [False, True])
def test_body_priority_is_honoured_only_from_a_trusted_proxy(tmp_path, trusted):
    """vLLM's ``priority`` field: a tailguard gateway in front (``send_priority``) passes its lane's priority this
    way, so a replica told to trust its proxy takes it; from anyone else it is ignored and recorded, as a claimed
    lane is."""
    engine = _PriorityEngine()
    with fake_server(tmp_path, engine=engine, trust_lane_header=trusted) as srv:
        url = srv.url
        r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 2,
                                                      "priority": -3})
        assert r.status_code == 200, r.text
        bad = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "hi", "priority": "high"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
        settle(srv)
        rec = httpx.get(url + f"/v1/requests/{r.headers['x-request-id']}",
                        headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    assert engine.priorities == ([-3] if trusted else [0])
    assert (rec.get("gateway") or {}).get("priority_ignored") == (None if trusted else -3)


def test_a_record_not_yet_written_reads_as_the_stored_one_will(tmp_path):
    """While the store's writer waits (a lock held by another process), the record is served from memory: the user
    pseudonymized and the stop strings withheld there too, as the store keeps them, not as the client sent them."""
    body = {**BODY, "user": "alice@example.com", "stop": ["my-secret-stop"]}
    with fake_server(tmp_path) as s:
        lock = sqlite3.connect(s.config.store_path, isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")  # the writer cannot commit until this ends
        try:
            r = httpx.post(s.url + "/v1/chat/completions", json=body, headers={"X-Request-ID": "early"})
            assert r.status_code == 200
            early = _get(s, "/v1/requests/early", ADMIN_KEY).json()
            assert sqlite3.connect(s.config.store_path).execute("SELECT COUNT(*) FROM requests").fetchone()[0] == 0
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        settle(s)
        stored = _get(s, "/v1/requests/early", ADMIN_KEY).json()
    assert "alice" not in str(early) and "my-secret-stop" not in str(early)
    assert early["user"] == stored["user"] and early["user"]
    assert early["sampling"]["stop"] is None and early["sampling"]["stop_count"] == 1


def test_made_up_business_types_cannot_fold_the_ones_the_slo_profiles_name(tmp_path):
    """Business types are capped as labels (the first 32 seen): callers refused for a bad key take none of them, and
    the types the SLO profiles select on keep their name whatever was sent first, in the record and the metrics."""
    from tailguard.slo.config import MonitorConfig

    key = "key-of-alice"
    with fake_server(tmp_path, api_key=key, slo=MonitorConfig(profiles=["strict-finance"])) as s, \
            httpx.Client(base_url=s.url) as c:
        for i in range(40):  # no key: refused, and their types take no label
            r = c.post("/v1/chat/completions", json=BODY, headers={"X-Business-Type": f"junk{i}"})
            assert r.status_code == 401
        ok = {"Authorization": f"Bearer {key}"}
        c.post("/v1/chat/completions", json=BODY, headers={**ok, "X-Request-ID": "first", "X-Business-Type": "t0"})
        for i in range(40):  # a caller with a key fills the 32 free labels
            c.post("/v1/chat/completions", json=BODY, headers={**ok, "X-Business-Type": f"made-up-{i}"})
        c.post("/v1/chat/completions", json=BODY,
               headers={**ok, "X-Request-ID": "fin", "X-Business-Type": "finance"})
        settle(s)
        first = _get(s, "/v1/requests/first", ADMIN_KEY).json()
        fin = _get(s, "/v1/requests/fin", ADMIN_KEY).json()
        metrics = c.get("/metrics").text
    assert first["business_type"] == "t0"  # the 40 refused callers took no label before it
    assert fin["business_type"] == "finance"
    assert 'business_type="finance"' in metrics and 'business_type="junk0"' not in metrics
    assert 'business_type="other"' in metrics  # the made-up types past the cap


def test_an_error_that_quotes_the_client_is_stored_masked(tmp_path):
    """An error message quotes what the client sent (an unknown model's name, an unknown field); without text storage
    the record still keeps no e-mail address, card number or credential from it."""
    secret = "alice@example.com 4111111111111111 sk-proj-abcDEF1234567890abcdefXYZ"
    with fake_server(tmp_path) as s:
        r = httpx.post(s.url + "/v1/chat/completions", json={**BODY, "model": secret},
                       headers={"X-Request-ID": "bad-model"})
        assert r.status_code == 404 and "alice@example.com" in r.json()["error"]["message"]  # the client's answer
        early = _get(s, "/v1/requests/bad-model", ADMIN_KEY).json()
        settle(s)
        stored = _get(s, "/v1/requests/bad-model", ADMIN_KEY).json()
        path = s.config.store_path
    for rec in (early, stored):
        assert "does not exist" in rec["error"]
        assert "alice@example.com" not in rec["error"] and "4111111111111111" not in rec["error"]
        assert "sk-proj" not in rec["error"] and "<EMAIL_ADDRESS>" in rec["error"]
    raw = sqlite3.connect(path).execute("SELECT error FROM requests").fetchall()
    assert raw and all("alice@example.com" not in str(row) for row in raw)
