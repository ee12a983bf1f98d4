"""The server's tokenize pipeline: prompts that arrive together are encoded as one batch off the event loop with the
same ids as one by one, cache hits never wait, and the domain glossary loads at start, reloads when its file changes
or on the admin call (admin key only) and never changes an id."""

from __future__ import annotations

import asyncio
import os
import random
import threading
from pathlib import Path

import httpx
import openai
import pytest

from tailguard.cli import build_parser
from tailguard.engine.model_store import ModelNotFoundError, resolve_model_path
from tailguard.engine.tokenizer import GGUFTokenizer
from tailguard.serving.config import ServerConfig
from tailguard.serving.server import ThreadedServer
from tailguard.serving.tokenize_pipeline import GlossaryFile, TokenizeBatcher, pipeline_of, read_terms
from tests.serving_helpers import ADMIN, fake_server, make_config, tiny_engine, wait_until

GLOSSARY = "# cardiology\n心肌梗死\n急性冠脉综合征\nmyocardial infarction\n\n  hypertension  \n心肌梗死\n"
CHATS = [
    [{"role": "user", "content": "请解释一下心肌梗死的症状和急救措施。"}],
    [{"role": "system", "content": "You are a careful clinician 🩺."},
     {"role": "user", "content": "What is diabetic nephropathy? Answer in 2 sentences."}],
    [{"role": "user", "content": "Emoji: 🤖🎉👍🏽 and a family 👨‍👩‍👧‍👦, 混合 mixed 文本."}],
]


@pytest.fixture(scope="module")
def smollm2():
    try:
        return resolve_model_path("smollm2")
    except ModelNotFoundError as exc:
        pytest.skip(f"model not available: {exc}")


@pytest.fixture(scope="module")
def plain(smollm2):
    return GGUFTokenizer(smollm2, cache_size=0)


def _texts(plain: GGUFTokenizer, n: int, seed: int = 0) -> list[str]:
    """``n`` prompts of 200-2,000 characters, English, Chinese and chat-templated, emoji among them."""
    root = Path(__file__).resolve().parents[2] / "benchmarks" / "data"
    sources = [(root / f"heldout_{lang}.txt").read_text(encoding="utf-8") * 4 for lang in ("en", "zh")]
    sources.append("🩺🤖🎉 emoji run 👨‍👩‍👧‍👦 " * 200)
    rng = random.Random(seed)
    out = [plain.render_chat(c) for c in CHATS]
    while len(out) < n:
        src = rng.choice(sources)
        size = rng.randint(200, 2000)
        start = rng.randint(0, len(src) - size)
        out.append(src[start:start + size])
    return out[:n]


class _Gated:
    """A tokenizer whose batch encode waits for ``gate``: a batch is then held on the worker thread."""

    def __init__(self, tok: GGUFTokenizer) -> None:
        self.tok, self.gate, self.calls = tok, threading.Event(), []

    def lookup(self, text: str) -> list[int] | None:
        return self.tok.lookup(text)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        self.calls.append(len(texts))
        assert self.gate.wait(10)
        return self.tok.encode_many(texts)


def test_batched_ids_equal_single_ids(smollm2, plain):
    tok = GGUFTokenizer(smollm2, cache_size=0)  # every round encodes
    texts = _texts(plain, 24)
    want = [plain.encode(t) for t in texts]

    async def main(cap: int) -> tuple[list[list[int]], TokenizeBatcher]:
        batcher = TokenizeBatcher(tok, inline_chars=0, max_batch_chars=cap)  # the short chat prompts too
        try:
            return list(await asyncio.gather(*(batcher.encode(t) for t in texts))), batcher
        finally:
            batcher.close()

    got, batcher = asyncio.run(main(10**7))
    assert got == want
    assert batcher.batches == 1 and batcher.largest == len(texts)  # they arrived in one turn of the loop
    # Under a character cap: several batches, in order, each at most the cap (or one text).
    got, batcher = asyncio.run(main(5000))
    assert got == want
    assert batcher.batches >= sum(map(len, texts)) // 5000 and batcher.batched_texts == len(texts)


def test_cache_hits_never_wait_and_arrivals_during_a_batch_form_the_next(smollm2, plain):
    tok = GGUFTokenizer(smollm2)
    gated = _Gated(tok)
    cached = "x" * 300
    tok.encode(cached)

    async def main() -> None:
        batcher = TokenizeBatcher(gated)
        first = [asyncio.ensure_future(batcher.encode(f"first batch {i} " * 30)) for i in range(3)]
        await asyncio.sleep(0.05)
        assert gated.calls == [3] and not any(f.done() for f in first)  # held on the worker
        # A hit answers at once, while the batch is held.
        assert await asyncio.wait_for(batcher.encode(cached), 1) == plain.encode(cached)
        assert batcher.hits == 1
        second = [asyncio.ensure_future(batcher.encode(f"second batch {i} " * 30)) for i in range(5)]
        await asyncio.sleep(0.05)
        assert gated.calls == [3]  # one batch at a time: these wait for it
        gated.gate.set()
        got = await asyncio.gather(*first, *second)
        assert gated.calls == [3, 5]
        assert got == [plain.encode(f"first batch {i} " * 30) for i in range(3)] + \
            [plain.encode(f"second batch {i} " * 30) for i in range(5)]
        batcher.close()

    asyncio.run(main())


def test_a_short_lone_prompt_is_encoded_inline_and_a_window_gathers_stragglers(smollm2, plain):
    tok = GGUFTokenizer(smollm2)

    async def main() -> None:
        inline = TokenizeBatcher(tok, inline_chars=256)
        assert await inline.encode("a short prompt") == plain.encode("a short prompt")
        assert inline.inline == 1 and inline.batches == 0
        inline.close()
        windowed = TokenizeBatcher(tok, window_s=0.2, inline_chars=0)

        async def later(i: int) -> list[int]:
            await asyncio.sleep(0.01 * i)
            return await windowed.encode(f"straggler {i}")

        got = await asyncio.gather(*(later(i) for i in range(4)))
        assert got == [plain.encode(f"straggler {i}") for i in range(4)]
        assert windowed.batches == 1 and windowed.largest == 4
        windowed.close()

    asyncio.run(main())


def test_a_bad_text_fails_only_its_own_request(smollm2, plain):
    tok = GGUFTokenizer(smollm2)

    async def main() -> None:
        batcher = TokenizeBatcher(tok, inline_chars=0)
        texts = ["fine one " * 20, "bad \ud800 one", "fine two " * 20]
        got = await asyncio.gather(*(batcher.encode(t) for t in texts), return_exceptions=True)
        assert got[0] == plain.encode(texts[0]) and got[2] == plain.encode(texts[2])
        assert isinstance(got[1], UnicodeEncodeError)
        assert batcher.batches == 1
        batcher.close()

    asyncio.run(main())


def test_glossary_file_terms_and_reload_on_change(tmp_path, smollm2, plain):
    path = tmp_path / "glossary.txt"
    path.write_text("\ufeff" + GLOSSARY, encoding="utf-8")
    assert read_terms(path) == ["心肌梗死", "急性冠脉综合征", "myocardial infarction", "hypertension"]
    tok = GGUFTokenizer(smollm2)
    gf = GlossaryFile(str(path))

    async def main() -> None:
        assert await gf.load(tok) and gf.terms == 4 and gf.loads == 1
        assert not await gf.load(tok)  # unchanged: not read again
        path.write_text("高血压\n", encoding="utf-8")
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        assert await gf.load(tok) and gf.terms == 1
        assert tok.lookup("心肌梗死") is None and tok.lookup("高血压") == plain.encode("高血压")
        path.unlink()
        with pytest.raises(OSError):
            await gf.load(tok)
        assert gf.error and tok.lookup("高血压") == plain.encode("高血压")  # the terms before stay

    asyncio.run(main())


def test_serve_flag_sets_the_glossary():
    args = build_parser().parse_args(["serve", "--tokenizer-glossary", "/srv/medical.txt"])
    assert args.tokenizer_glossary == "/srv/medical.txt"
    assert ServerConfig.load(tokenizer_glossary="/srv/medical.txt").tokenizer_glossary == "/srv/medical.txt"


@pytest.fixture(scope="module")
def glossary_server(tmp_path_factory, smollm2):
    tmp = tmp_path_factory.mktemp("glossary")
    path = tmp / "medical.txt"
    path.write_text(GLOSSARY, encoding="utf-8")
    cfg = make_config(tmp, model="tiny", tokenizer_glossary=str(path), tokenizer_glossary_poll_s=0.05,
                      tokenize_batch_window_s=0.05, api_key="sk-client")
    with ThreadedServer(cfg, tiny_engine()) as s:
        yield s, path


def _glossary(url: str, headers: dict | None = None, method: str = "GET") -> httpx.Response:
    return httpx.request(method, url + "/admin/tokenizer/glossary", headers=headers, timeout=30)


def test_glossary_loads_at_start_and_hot_reloads(glossary_server, plain):
    server, path = glossary_server
    r = _glossary(server.url, ADMIN)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["glossary"]["terms"] == 4 and body["glossary"]["loads"] >= 1 and body["glossary"]["error"] is None
    assert body["cache"]["glossary_terms"] == 4
    tok = server.state.engine.tokenizer
    assert tok.lookup("心肌梗死") == plain.encode("心肌梗死")
    # The file changes: the poll picks it up without a restart.
    path.write_text(GLOSSARY + "糖尿病肾病\ndiabetic nephropathy\n", encoding="utf-8")
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert wait_until(lambda: _glossary(server.url, ADMIN).json()["glossary"]["terms"] == 6, timeout=10)
    assert tok.lookup("diabetic nephropathy") == plain.encode("diabetic nephropathy")


def test_glossary_admin_reload_needs_the_admin_key(glossary_server):
    server, path = glossary_server
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer sk-client"}):
        for method in ("GET", "POST"):
            r = _glossary(server.url, headers, method)
            assert r.status_code in (401, 403), (method, headers, r.text)
            assert "error" in r.json()
    loads = _glossary(server.url, ADMIN).json()["glossary"]["loads"]
    r = _glossary(server.url, ADMIN, "POST")
    assert r.status_code == 200, r.text
    assert r.json()["glossary"]["loads"] == loads + 1  # forced: loaded again though unchanged
    # A file that cannot be read: 409, and the glossary before stays.
    terms = r.json()["glossary"]["terms"]
    saved = path.read_bytes()
    path.write_bytes(b"\xff\xfe not utf-8")
    try:
        r = _glossary(server.url, ADMIN, "POST")
        assert r.status_code == 409 and r.json()["error"]["code"] == "glossary_unreadable", r.text
        assert _glossary(server.url, ADMIN).json()["glossary"]["terms"] == terms
    finally:
        path.write_bytes(saved)


def test_concurrent_requests_get_their_own_prompts_through_the_batcher(glossary_server, plain):
    server, _ = glossary_server
    texts = _texts(plain, 16, seed=1)
    texts = [t[:600] for t in texts]  # the tiny model's context and KV stay small
    state = server.state
    before = pipeline_of(state).describe()["batching"] or {"batches": 0, "batched_texts": 0}

    async def main() -> list:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-client", max_retries=0,
                                      timeout=120) as c:
            async def one(text: str):
                return await c.completions.create(model="tiny", prompt=text, max_tokens=2, temperature=0)

            async def chat(msgs: list[dict]):
                return await c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, temperature=0)

            return await asyncio.gather(*(one(t) for t in texts), *(chat(m) for m in CHATS))

    results = asyncio.run(main())
    for text, r in zip(texts, results):
        assert r.usage.prompt_tokens == len(plain.encode(text))
    for msgs, r in zip(CHATS, results[len(texts):]):
        assert r.usage.prompt_tokens == len(plain.encode(plain.render_chat(msgs)))
    after = pipeline_of(state).describe()["batching"]
    assert after["batched_texts"] - before["batched_texts"] > after["batches"] - before["batches"], \
        "no two prompts shared a batch"
    # The same prompts again, one at a time: the same greedy answers (the ids were the same).
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-client", max_retries=0, timeout=120)
    for text, r in list(zip(texts, results))[:4]:
        again = client.completions.create(model="tiny", prompt=text, max_tokens=2, temperature=0)
        assert again.choices[0].text == r.choices[0].text


def test_a_server_without_a_glossary_answers_404_on_reload(tmp_path):
    with fake_server(tmp_path) as s:
        r = _glossary(s.url, ADMIN, "POST")
        assert r.status_code == 404 and r.json()["error"]["code"] == "glossary_unavailable"
        assert _glossary(s.url, ADMIN).json()["glossary"] is None
    # A tokenizer with no cache (the scripted fake's): the server runs, and says why the glossary is not used.
    path = tmp_path / "terms.txt"
    path.write_text(GLOSSARY, encoding="utf-8")
    with fake_server(tmp_path, tokenizer_glossary=str(path)) as s:
        assert "no cache" in _glossary(s.url, ADMIN).json()["glossary"]["error"]
        assert _glossary(s.url, ADMIN, "POST").status_code == 404
        r = httpx.post(s.url + "/v1/completions", json={"model": "fake", "prompt": "心肌梗死", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200


def test_batching_off_keeps_the_inline_path(tmp_path):
    with fake_server(tmp_path, tokenize_batching=False) as s:
        r = httpx.post(s.url + "/v1/completions", json={"model": "fake", "prompt": "hello " * 100, "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 600
        assert pipeline_of(s.state).describe()["batching"] is None
