"""Bounded work before admission, and the small doors a hostile client tried: an oversized body or prompt is refused
before it is read or tokenized, the auth scheme is case-insensitive, and a client always finds its own records."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tailguard.engine.fake import FakeEngine, FakeTiming
from tests.serving_helpers import ADMIN, fake_server, settle

KEY_A, KEY_B = "key-of-client-a", "key-of-client-b"


def chat(content: str, **kw) -> dict:
    return {"model": "fake", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **kw}


class CountingEngine(FakeEngine):
    """The fake engine, counting what its tokenizer is asked to encode."""

    def __init__(self, **kw) -> None:
        super().__init__(FakeTiming(ttft=0.002, itl=0.001), **kw)
        self.encoded_chars = 0
        encode = self.tokenizer.encode

        def counting(text: str) -> list[int]:
            self.encoded_chars += len(text)
            return encode(text)

        self.tokenizer.encode = counting


def test_a_prompt_longer_than_the_context_window_can_hold_is_refused_untokenized(tmp_path):
    engine = CountingEngine(max_model_len=2048)  # one byte a token: at most 2,048 characters fit
    with fake_server(tmp_path, engine=engine) as server:
        r = httpx.post(server.url + "/v1/chat/completions", json=chat("x" * 5000), timeout=30)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and "5,0" in err["message"]
        assert engine.encoded_chars == 0  # refused on its characters alone
        ok = httpx.post(server.url + "/v1/chat/completions", json=chat("x" * 100), timeout=30)
        assert ok.status_code == 200 and engine.encoded_chars > 0


def test_an_oversized_body_is_refused_from_its_content_length_before_it_is_read(tmp_path):
    engine = CountingEngine(max_model_len=2048)
    with fake_server(tmp_path, engine=engine) as server:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            # 15 MB announced (under the 16 MiB configured limit, far over what 2,048 tokens can take); none sent.
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 15000000\r\n\r\n")
            t0 = time.monotonic()
            head = sock.recv(65536)
            waited = time.monotonic() - t0
        assert head.startswith(b"HTTP/1.1 413"), head[:200]
        assert b'"error"' in head or b"error" in head
        assert waited < 5  # answered without waiting for the 15 MB
        assert engine.encoded_chars == 0


def test_a_chunked_body_is_cut_at_the_bound(tmp_path):
    engine = CountingEngine(max_model_len=2048)
    with fake_server(tmp_path, engine=engine) as server:
        big = json.dumps(chat("y" * 400_000)).encode()  # past 2,048 x 12 bytes + room for the other fields

        def chunks():
            for i in range(0, len(big), 65536):
                yield big[i:i + 65536]

        r = httpx.post(server.url + "/v1/chat/completions", content=chunks(), timeout=30,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["message"]
        assert engine.encoded_chars == 0


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_auth_scheme_is_case_insensitive(tmp_path, scheme):
    with fake_server(tmp_path, api_keys=[KEY_A]) as server:
        r = httpx.post(server.url + "/v1/chat/completions", json=chat("hi"),
                       headers={"Authorization": f"{scheme} {KEY_A}"}, timeout=30)
        assert r.status_code == 200


@pytest.mark.parametrize("header", [f"Basic {KEY_A}", KEY_A, "Bearer", f"Bearer{KEY_A}", f"Bearer {KEY_B}"])
def test_other_schemes_and_malformed_headers_are_refused(tmp_path, header):
    with fake_server(tmp_path, api_keys=[KEY_A]) as server:
        r = httpx.post(server.url + "/v1/chat/completions", json=chat("hi"), headers={"Authorization": header},
                       timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_a_client_always_finds_its_own_record_whoever_reuses_its_id(tmp_path):
    with fake_server(tmp_path, api_keys=[KEY_A, KEY_B]) as server, httpx.Client(base_url=server.url,
                                                                                timeout=30) as c:
        a = {"Authorization": f"Bearer {KEY_A}", "X-Request-ID": "shared-id-1"}
        b = {"Authorization": f"Bearer {KEY_B}", "X-Request-ID": "shared-id-1"}
        assert c.post("/v1/chat/completions", json=chat("from a", user="alice"), headers=a).status_code == 200
        for _ in range(70):  # more than any fixed window of rows with that id
            assert c.post("/v1/chat/completions", json=chat("from b"), headers=b).status_code == 200
        settle(server)
        mine = c.get("/v1/requests/shared-id-1", headers={"Authorization": f"Bearer {KEY_A}"})
        assert mine.status_code == 200 and mine.json()["prompt_tokens"] != 0
        theirs = c.get("/v1/requests/shared-id-1", headers={"Authorization": f"Bearer {KEY_B}"})
        assert theirs.status_code == 200
        assert mine.json()["owner"] != theirs.json()["owner"]
        assert mine.json()["received_at"] < theirs.json()["received_at"]
        assert c.get("/v1/requests/shared-id-1", headers=ADMIN).json()["owner"] == theirs.json()["owner"]


def test_the_token_floor_never_exceeds_the_real_count(tokenizer):
    import random

    rng = random.Random(0)
    pieces = ["深度学习", "hello", " ", "1234567", "\U0001f642", "─" * 8, "#" * 90, "\n" * 5, "é", "x", "3.14"]
    for _ in range(500):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 80)))
        assert tokenizer.min_tokens(text) <= len(tokenizer.encode(text)), text


def test_a_huge_chinese_prompt_is_over_the_window_by_its_floor_alone(tokenizer):
    text = "深度学习模型的推理延迟" * 55_000  # 605,000 characters: under the character bound (81 a token)
    assert len(text) < 8192 * tokenizer.max_token_chars
    assert tokenizer.min_tokens(text) > 8192  # refused before a tokenize that would take seconds here
