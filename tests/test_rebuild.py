"""``tailguard rebuild``: a request served with a sealing key is run again by its ID, with its own token ids,
sampling and seed, and gives the same tokens; the token ids are kept only sealed, a wrong key opens nothing, and
the requests it shared the engine with are found in the store."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tailguard.engine.model_store import ModelNotFoundError, resolve_model_path
from tailguard.observe.sealing import new_key
from tests.serving_helpers import make_config, settle, tiny_engine

ENGINE_FLAGS = ["--model", "tiny", "--kv-cache-tokens", "4096", "--max-num-seqs", "16",
                "--max-num-batched-tokens", "256", "--threads", "1"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    try:
        resolve_model_path("smollm2")  # the tiny model borrows the real model's tokenizer
    except ModelNotFoundError as exc:
        pytest.skip(f"model not available: {exc}")
    from tailguard.serving.server import ThreadedServer

    tmp = tmp_path_factory.mktemp("rebuild")
    key_file = tmp / "seal.key"
    key_file.write_text(new_key() + "\n")
    cfg = make_config(tmp, model="tiny", seal_key_file=str(key_file))
    with ThreadedServer(cfg, tiny_engine()) as s:
        yield s, key_file, cfg.store_path


def _ask(url: str, rid: str, **kw) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"Tell me about the sea ({rid})."}],
            "max_tokens": 12, "temperature": 1.0, "ignore_eos": True, **kw}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"X-Request-ID": rid}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _rebuild(capsys, rid: str, store: str, key_file: Path, *extra: str) -> dict:
    from tailguard.cli import main

    assert main(["rebuild", rid, "--store", store, "--seal-key-file", str(key_file), "--json", *ENGINE_FLAGS,
                 *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_request_without_a_seed_is_rebuilt_token_for_token(served, capsys):
    s, key_file, store = served
    answer = _ask(s.url, "rb-unseeded")
    settle(s)
    rec = s.state.store.get("rb-unseeded")
    assert rec["sealed"] and rec.get("prompt_token_ids") is None  # kept only sealed, never in the clear
    assert rec["sampling"]["seed"] is None  # the client gave none; the sealed one is the server's
    out = _rebuild(capsys, "rb-unseeded", store, key_file)
    assert out["same_output"] and out["first_difference"] is None
    assert len(out["rebuilt_ids"]) == 12 == answer["usage"]["completion_tokens"]
    assert out["seed_given"] is False and out["sampling"]["seed"] is not None
    engine = tiny_engine()
    assert engine.tokenizer.decode(out["rebuilt_ids"]) == answer["choices"][0]["message"]["content"]
    prompt_steps = [st for st in out["steps"] if st["token"] is None or st["computed"] > 1]
    assert sum(st["computed"] for st in prompt_steps) >= out["prompt_tokens"] - 16  # the prompt, in chunks
    assert len(out["original_token_times"]) == 12 and len(out["rebuilt_token_times"]) == 12


def test_a_seeded_request_keeps_its_seed_and_a_changed_answer_is_shown(served, capsys):
    s, key_file, store = served
    _ask(s.url, "rb-seeded", seed=1234, presence_penalty=0.5, logit_bias={"42": 5})
    settle(s)
    out = _rebuild(capsys, "rb-seeded", store, key_file)
    assert out["seed_given"] is True and out["sampling"]["seed"] == 1234
    assert out["sampling"]["presence_penalty"] == 0.5 and out["sampling"]["logit_bias"] == {"42": 5.0}
    assert out["same_output"]
    # The same request on an engine with another KV cache format computes other numbers: the rebuild says where
    # the answer changed, if it did, and always which engine ran it.
    other = _rebuild(capsys, "rb-seeded", store, key_file, "--kv-cache-dtype", "float32")
    assert "float32" in other["engine"]
    for d in other["differences"]:
        assert d["original"] != d["rebuilt"]


def test_the_batch_it_shared_is_found(served, capsys):
    s, key_file, store = served
    with ThreadPoolExecutor(4) as pool:
        # Long enough answers that the four are in the engine together (the tiny model decodes in milliseconds).
        list(pool.map(lambda i: _ask(s.url, f"rb-batch-{i}", max_tokens=200), range(4)))
    settle(s)
    out = _rebuild(capsys, "rb-batch-0", store, key_file)
    shared = {x["request_id"] for x in out["shared"]}
    assert shared & {"rb-batch-1", "rb-batch-2", "rb-batch-3"}, out["shared"]
    assert all(x["overlap_s"] >= 0 for x in out["shared"])


def test_a_wrong_key_or_an_unsealed_record_is_a_clear_error(served, tmp_path, capsys):
    from tailguard.cli import main

    s, _, store = served
    _ask(s.url, "rb-wrong-key")
    settle(s)
    wrong = tmp_path / "wrong.key"
    wrong.write_text(new_key())
    assert main(["rebuild", "rb-wrong-key", "--store", store, "--seal-key-file", str(wrong), *ENGINE_FLAGS]) == 1
    assert "does not open" in capsys.readouterr().err
    assert main(["rebuild", "no-such-id", "--store", store, "--seal-key-file", str(wrong), *ENGINE_FLAGS]) == 1
    assert "no record" in capsys.readouterr().err


def test_the_html_page_has_the_timeline(served, tmp_path, capsys):
    from tailguard.cli import main

    s, key_file, store = served
    _ask(s.url, "rb-html")
    settle(s)
    page = tmp_path / "rebuild.html"
    assert main(["rebuild", "rb-html", "--store", store, "--seal-key-file", str(key_file), "--html", str(page),
                 *ENGINE_FLAGS]) == 0
    text = capsys.readouterr().out
    assert "same output" in text and "step timeline" in text
    html = page.read_text()
    assert "tokens over time" in html and "plotly" in html.lower()


# --- errors that need no model: a store URL's password is never printed; an --html path that cannot be written is
# refused before the (long) rebuild, and a write that fails anyway is one line, not a traceback.

PG_URL = "postgresql://tg:PGSECRETPW@127.0.0.1:18559/tgdb"


class _EmptyStore:
    def get(self, request_id: str) -> None:
        return None

    def close(self) -> None:
        pass


def test_a_missing_record_names_the_store_without_its_password(monkeypatch):
    import tailguard.observe.stores as stores
    from tailguard.rebuild import RebuildError, fetch

    monkeypatch.setattr(stores, "open_store", lambda target, **kw: _EmptyStore())
    with pytest.raises(RebuildError) as err:
        fetch("nosuchid", PG_URL)
    assert "no record of request 'nosuchid'" in str(err.value)
    assert "PGSECRETPW" not in str(err.value) and "tg:***@127.0.0.1" in str(err.value)


def test_a_store_that_cannot_be_opened_does_not_print_the_password(monkeypatch):
    import tailguard.observe.stores as stores
    from tailguard.rebuild import RebuildError, fetch

    def refuse(target: str, **kw) -> None:
        raise RuntimeError(f"cannot connect to {target}: password PGSECRETPW rejected")

    monkeypatch.setattr(stores, "open_store", refuse)
    with pytest.raises(RebuildError) as err:
        fetch("x", PG_URL)
    assert "PGSECRETPW" not in str(err.value) and "cannot read the store" in str(err.value)


@pytest.mark.parametrize("html", ["/proc/x.html", "/nonexistent-dir/x.html", "DIR"])
def test_an_unwritable_html_path_is_refused_before_the_rebuild(tmp_path, capsys, html):
    from tailguard.cli import main

    key = tmp_path / "seal.key"
    key.write_text(new_key() + "\n")
    target = str(tmp_path) if html == "DIR" else html
    # the store does not exist either: the --html check must come first, before any work
    rc = main(["rebuild", "someid", "--store", str(tmp_path / "none.sqlite"), "--seal-key-file", str(key),
               "--html", target])
    err = capsys.readouterr().err
    assert rc != 0 and f"cannot write {target}" in err and "Traceback" not in err
    assert not Path(target).is_file()


def test_a_failed_html_write_is_a_rebuild_error(tmp_path):
    from tailguard.rebuild import RebuildError, Rebuilt, write_html

    r = Rebuilt(request_id="r1", engine="test", prompt_tokens=1, sampling={}, seed_given=False, original_ids=[1],
                rebuilt_ids=[1], steps=[], original_token_times=[0.1], rebuilt_token_times=[0.1])
    with pytest.raises(RebuildError, match=f"cannot write {tmp_path}"):
        write_html(r, tmp_path)
