"""OpenAI's sampling features in the engine: presence/frequency penalties, vLLM's repetition penalty, logit_bias and
structured output (JSON schema, JSON object, regex, grammar), on both runners (the native runner's numpy sampler and
the torch runner's), and what they must not touch: a request without them, a neighbour whose spec is broken."""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections import Counter

import numpy as np
import pytest

from tailguard.engine import kernels
from tailguard.engine.engine import AsyncLLMEngine, EngineArgs, LLMEngine
from tailguard.engine.sampling import LogitsState
from tailguard.engine.sequence import FinishReason, RequestError, SamplingParams, Sequence, SequenceFailed
from tailguard.engine.structured import GrammarMatcher, StructuredOutput

pytest.importorskip("llguidance")
needs_kernels = pytest.mark.skipif(not kernels.available(), reason="the native runner runs tailguard's kernels (gcc)")
RUNNERS = [pytest.param("native", marks=needs_kernels), "torch"]


def _build(path, runner: str, **kw) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(path), runner=runner, kv_cache_tokens=8192, max_model_len=512,
                                num_threads=1, max_num_batched_tokens=64, max_prefill_chunk=48, **kw))


@pytest.fixture(scope="module")
def engines(tiny_gguf) -> dict[str, LLMEngine]:
    out = {"torch": _build(tiny_gguf, "torch")}
    if kernels.available():
        out["native"] = _build(tiny_gguf, "native")
    return out


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def prompts(n: int = 12, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randint(3, 30))] for _ in range(n)]


def repeats(outputs: list[list[int]]) -> int:
    """Tokens that repeat an earlier token of their own output."""
    return sum(len(o) - len(set(o)) for o in outputs)


def run(engine: LLMEngine, items: list[tuple[list[int], SamplingParams]]) -> list[list]:
    """Run requests together; each one's events, in order."""
    ids = [engine.add_request(p, sp) for p, sp in items]
    events: dict[str, list] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for ev in engine.step():
            events[ev.request_id].append(ev)
    assert engine.pool.num_used == 0 and engine.pool.owners() == set() and not engine._tracked
    return [events[rid] for rid in ids]


def tokens(events: list) -> list[int]:
    return [ev.token_id for ev in events if ev.token_id is not None]


def regex_literal(text: str) -> str:
    """A regex (Rust syntax) that matches exactly ``text``."""
    out = []
    for ch in text:
        if ch == "\n":
            out.append(r"\n")
        elif ch == "\t":
            out.append(r"\t")
        elif ch == "\r":
            out.append(r"\r")
        elif ch.isascii() and not ch.isalnum() and ch not in " <>":
            out.append("\\" + ch)
        else:
            out.append(ch)
    return "".join(out)


# --- parameters -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [
    {"presence_penalty": 2.5}, {"presence_penalty": -2.01}, {"frequency_penalty": float("nan")},
    {"frequency_penalty": 3}, {"repetition_penalty": 0.0}, {"repetition_penalty": -1.0},
    {"repetition_penalty": float("inf")}, {"logit_bias": {5: 100.5}}, {"logit_bias": {5: -101}},
    {"logit_bias": {-1: 1.0}}, {"logit_bias": {"5": 1.0}}, {"logit_bias": {5: float("nan")}},
    {"structured": StructuredOutput("yaml", "a: 1")}, {"structured": StructuredOutput("regex", "")},
    {"structured": StructuredOutput("json_schema", "  ")},
])
def test_out_of_range_parameters_are_refused(kw):
    with pytest.raises(RequestError):
        SamplingParams(**kw).validate()


def test_in_range_parameters_pass():
    SamplingParams(presence_penalty=-2, frequency_penalty=2.0, repetition_penalty=1.3,
                   logit_bias={0: -100, 49151: 100.0}, structured=StructuredOutput("json_object")).validate(49152)


def test_a_logit_bias_outside_the_vocabulary_is_refused_at_admission(engines):
    engine = engines["torch"]
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request([1, 2, 3], greedy(logit_bias={engine.config.vocab_size: 5.0}))
    assert not engine.has_unfinished()


def test_the_transform_is_openai_and_vllm_arithmetic():
    seq = Sequence("r", [1, 2], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                                              logit_bias={5: 1.5, 2: -3.0}))
    seq.output_token_ids = [3, 3, 4]
    row = np.array([1.0, -1.0, 4.0, -2.0, 6.0, 0.5, 7.0], dtype=np.float32)
    out = LogitsState(seq).process(row, seq, banned=[])
    expected = row.copy()
    expected[[5, 2]] += [1.5, -3.0]  # bias first
    for t in (1, 2, 3, 4):  # prompt and output tokens: divide positives, multiply negatives
        expected[t] = expected[t] / 2 if expected[t] > 0 else expected[t] * 2
    expected[3] -= 0.25 * 2 + 0.5  # generated twice
    expected[4] -= 0.25 * 1 + 0.5  # once; prompt tokens 1, 2 carry no frequency/presence penalty
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert row[5] == 0.5  # the step's logits are left as they were
    seq.output_token_ids.append(6)  # counts follow the output
    assert LogitsState(seq).process(row, seq, [])[6] == pytest.approx(7.0 / 2 - 0.75)


def test_the_greedy_shortcut_is_the_masked_argmax(engines):
    """greedy_token checks the row's own argmax against the grammar before building the mask: always the argmax of
    the fully transformed row (biases and penalties, the min_tokens ban, the grammar), refused argmax or not."""
    engine = engines["torch"]
    rng = np.random.default_rng(0)
    vocab = engine.config.vocab_size
    text = '{"ok": true, "n": 12}'
    schema = StructuredOutput("json_schema", '{"type":"object","properties":{"ok":{"type":"boolean"},'
                                             '"n":{"type":"integer"}},"required":["ok","n"]}')
    sp = SamplingParams(frequency_penalty=0.5, logit_bias={int(t): 5.0 for t in rng.integers(0, vocab, 50)},
                        min_tokens=4, structured=schema)
    seq = Sequence("g", [1, 2, 3], sp)
    state = LogitsState(seq, engine.grammars.matcher(schema))
    refused = 0
    for tok in engine.tokenizer.encode(text):
        for _ in range(20):
            row = rng.standard_normal(vocab).astype(np.float32) * 4
            if rng.random() < 0.5:
                row[tok] += 20  # the model agrees with the grammar: the shortcut's case
            banned = [engine.tokenizer.eos_token_id] if len(seq.output_token_ids) < 4 else []
            full = state.process(row, seq, banned)
            assert state.greedy_token(row, seq, banned) == int(full.argmax())
            refused += not state.matcher.allows(int(row.argmax()))
        state.matcher.advance(tok)
        seq.output_token_ids.append(tok)
    assert refused > 20


# --- neutral values -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("runner", RUNNERS)
def test_neutral_values_change_nothing_and_cost_nothing(engines, runner, monkeypatch):
    engine = engines[runner]
    ps = prompts(6, seed=3)
    plain = engine.generate(ps, greedy())
    rid = engine.add_request(ps[0], greedy(presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1.0,
                                           logit_bias={}, structured=None))
    assert engine._tracked[rid].seq.logits_state is None  # nothing to do at any step
    engine.abort(rid)

    def never(*args, **kwargs):
        raise AssertionError("a request without penalties, bias or grammar had its logits transformed")

    monkeypatch.setattr(LogitsState, "process", never)
    neutral = engine.generate(ps, greedy(presence_penalty=0.0, frequency_penalty=0, repetition_penalty=1,
                                         logit_bias=None))
    assert neutral == plain


# --- penalties and logit bias ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_full_logit_bias_makes_greedy_emit_that_token(engines, runner):
    engine = engines[runner]
    ps = prompts(4, seed=5)
    for target in (1000, 31337):
        outs = engine.generate(ps, greedy(8, logit_bias={target: 100}))
        assert all(o == [target] * 8 for o in outs)
    plain = engine.generate(ps, greedy(1))
    banned = engine.generate(ps, greedy(1, logit_bias={o[0]: -100 for o in plain}))
    assert all(b[0] != p[0] for b, p in zip(banned, plain))


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("penalty", [{"frequency_penalty": 1.0}, {"presence_penalty": 1.0},
                                     {"repetition_penalty": 1.5}])
def test_penalties_reduce_the_repeats_of_greedy_loops(engines, runner, penalty):
    engine = engines[runner]
    ps = prompts(12, seed=0)
    plain = engine.generate(ps, greedy(48))
    assert repeats(plain) >= 10, "the prompts should drive the tiny model into greedy loops"
    penalized = engine.generate(ps, greedy(48, **penalty))
    assert repeats(penalized) < repeats(plain) / 2
    loop = max(range(len(ps)), key=lambda i: Counter(plain[i]).most_common(1)[0][1])
    assert Counter(penalized[loop]).most_common(1)[0][1] < Counter(plain[loop]).most_common(1)[0][1]


def test_negative_penalties_encourage_repeats(engines):
    engine = engines["torch"]
    ps = prompts(12, seed=0)
    assert repeats(engine.generate(ps, greedy(32, presence_penalty=-2.0))) > repeats(engine.generate(ps, greedy(32)))


@needs_kernels
def test_native_and_torch_runners_choose_the_same_tokens(engines):
    ps = prompts(8, seed=11)
    params = [greedy(20, frequency_penalty=0.7), greedy(20, presence_penalty=1.2, logit_bias={500: 3.0, 900: -50}),
              greedy(20, repetition_penalty=1.3), greedy(20, frequency_penalty=-0.4, repetition_penalty=0.8),
              greedy(20, structured=StructuredOutput("regex", "(yes|no|maybe)[a-z ]{0,30}")),
              greedy(20, presence_penalty=0.5, structured=StructuredOutput(
                  "json_schema", '{"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"]}')),
              greedy(20), greedy(20, logit_bias={42: 100})]
    outs = {}
    for name in ("native", "torch"):
        events = run(engines[name], [(p, sp) for p, sp in zip(ps, params)])
        outs[name] = [(tokens(ev), ev[-1].finish_reason) for ev in events]
    assert outs["native"] == outs["torch"]


@pytest.mark.parametrize("runner", RUNNERS)
def test_sampled_requests_take_penalties_and_repeat_with_a_seed(engines, runner):
    engine = engines[runner]
    ps = prompts(4, seed=2)
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=123, ignore_eos=True,
                        frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.2, logit_bias={7: 2.0})
    first = engine.generate(ps, sp)
    assert first == engine.generate(ps, sp) and all(len(o) == 16 for o in first)


# --- structured output ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("runner", RUNNERS)
def test_regex_and_schema_outputs_hold_on_the_tiny_model(engines, runner):
    engine = engines[runner]
    ps = prompts(6, seed=4)
    rx = r"(yes|no), [0-9]{3}!"
    schema = {"type": "object", "properties": {"flag": {"type": "boolean"},
                                               "color": {"enum": ["red", "green", "blue"]},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                        "maxItems": 3}},
              "required": ["flag", "color", "tags"], "additionalProperties": False}
    items = [(p, SamplingParams(max_tokens=64, temperature=t, seed=9, structured=StructuredOutput("regex", rx)))
             for p in ps for t in (0.0, 1.0)]
    items += [(p, SamplingParams(max_tokens=64, temperature=t, seed=9,
                                 structured=StructuredOutput("json_schema", json.dumps(schema))))
              for p in ps for t in (0.0, 1.0)]
    items += [(p, SamplingParams(max_tokens=64, temperature=0, structured=StructuredOutput(
        "grammar", 'root ::= "The answer is " ("yes" | "no") "."'))) for p in ps[:2]]
    for (_, sp), events in zip(items, run(engine, items)):
        text = "".join(ev.text for ev in events)
        assert events[-1].finish_reason is FinishReason.STOP, (sp.structured, text)
        assert engine.stop_ids.isdisjoint(tokens(events))  # the grammar ended it, not an EOS
        kind = sp.structured.kind if sp.structured else ""
        if kind == "regex":
            assert re.fullmatch(r"(yes|no), [0-9]{3}!", text), text
        elif kind == "json_schema":
            doc = json.loads(text)
            assert set(doc) == {"flag", "color", "tags"} and isinstance(doc["flag"], bool)
            assert doc["color"] in ("red", "green", "blue") and set(doc["tags"]) <= {"a", "b"}
            assert len(doc["tags"]) <= 3
        else:
            assert text in ("The answer is yes.", "The answer is no."), text


@pytest.mark.parametrize("runner", RUNNERS)
def test_eos_is_allowed_only_where_the_grammar_accepts(engines, runner):
    """A regex that may stop or go on: greedy with a +100 bias on EOS takes EOS at the first accepting point, never
    before; min_tokens cannot hold a complete grammar open."""
    engine = engines[runner]
    eos = engine.tokenizer.eos_token_id
    p = prompts(1, seed=6)[0]
    sp = SamplingParams(max_tokens=40, temperature=0, logit_bias={eos: 100},
                        structured=StructuredOutput("regex", "abc(d+)?"))
    (events,) = run(engine, [(p, sp)])
    assert "".join(ev.text for ev in events) == "abc" and tokens(events)[-1] == eos
    assert events[-1].finish_reason is FinishReason.STOP
    sp = SamplingParams(max_tokens=40, min_tokens=30, temperature=0, structured=StructuredOutput("regex", "xyz"))
    (events,) = run(engine, [(p, sp)])
    assert "".join(ev.text for ev in events) == "xyz" and events[-1].finish_reason is FinishReason.STOP


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_grammar_equals_unconstrained_greedy_where_that_already_fits(engines, runner):
    """Greedy under a grammar that accepts the unconstrained greedy output (exactly, or as a prefix of more) gives
    that output token for token: the mask only removes tokens greedy would not have chosen."""
    engine = engines[runner]
    checked = 0
    for p in prompts(16, seed=8):
        plain = engine.generate([p], greedy(16))[0]
        text = engine.tokenizer.decode(plain, skip_special_tokens=False)
        if engine.tokenizer.special_ids.intersection(plain) or "\ufffd" in text or not text:
            continue  # a special token or a split character: no regex over text can hold it
        exact = run(engine, [(p, greedy(16, structured=StructuredOutput("regex", regex_literal(text))))])[0]
        assert tokens(exact) == plain and exact[-1].finish_reason is FinishReason.STOP
        wider = run(engine, [(p, greedy(16, structured=StructuredOutput("regex", regex_literal(text) + r"[\s\S]*")))])[0]
        assert tokens(wider) == plain and wider[-1].finish_reason is FinishReason.LENGTH
        checked += 1
    assert checked >= 4


def test_specs_compile_once_each(engines):
    engine = engines["torch"]
    grammars = engine.grammars
    so = StructuredOutput("regex", "(cached|once)")
    before = grammars.compiles
    run(engine, [(p, greedy(8, structured=so)) for p in prompts(5, seed=1)])
    run(engine, [(prompts(1)[0], greedy(8, structured=StructuredOutput("regex", "(cached|once)")))])
    assert grammars.compiles == before + 1


def test_the_compiled_specs_kept_are_bounded_by_their_size_too(engines):
    from tailguard.engine.structured import GrammarCompiler

    engine = engines["torch"]
    grammars = GrammarCompiler(engine.tokenizer, engine.grammars.vocab_size, set(engine.stop_ids),
                               cache_entries=100, cache_spec_chars=3000)
    specs = [StructuredOutput("regex", f"(a{i}|" + "b" * 995 + ")") for i in range(5)]  # ~1,000 characters each
    for so in specs:
        grammars.compiled(so)
    assert grammars.compiles == 5
    grammars.compiled(specs[-1])  # the newest stayed
    grammars.compiled(specs[2])  # within 3,000 characters: the last three stayed
    assert grammars.compiles == 5
    grammars.compiled(specs[0])  # an old one was dropped
    assert grammars.compiles == 6


@pytest.mark.parametrize("spec", [
    StructuredOutput("json_schema", '{"type": "objekt"}'), StructuredOutput("json_schema", "{not json"),
    StructuredOutput("json_schema", "[1, 2]"), StructuredOutput("regex", "a(b"),
    StructuredOutput("grammar", "start: undefined_rule"), StructuredOutput("grammar", "root ::= ("),
])
def test_a_broken_spec_fails_its_request_alone(engines, spec):
    engine = engines["torch"]
    ok = engine.add_request([5, 6, 7], greedy(12), "neighbour")
    events = engine.step()  # the neighbour is under way when the broken request comes
    with pytest.raises(RequestError, match="does not compile"):
        engine.add_request([5, 6, 7], greedy(12, structured=spec), "broken")
    assert "broken" not in engine._tracked
    while engine.has_unfinished():
        events += engine.step()
    assert {ev.request_id for ev in events} == {ok}
    assert events[-1].finish_reason is FinishReason.LENGTH and len(tokens(events)) == 12


def test_the_async_front_refuses_a_broken_schema_and_serves_the_rest(tiny_gguf):
    front = AsyncLLMEngine(_build(tiny_gguf, "torch"))
    good = StructuredOutput("regex", "[a-z]{1,20}")

    async def drain(rid: str, sp: SamplingParams) -> tuple[int, BaseException | None]:
        got = 0
        try:
            async for ev in front.generate([9, 8, 7, 6], sp, rid):
                got += ev.token_id is not None
        except Exception as exc:  # noqa: BLE001 - the test looks at which
            return got, exc
        return got, None

    async def main():
        return await asyncio.wait_for(asyncio.gather(
            drain("plain", greedy(10)), drain("broken", greedy(10, structured=StructuredOutput("json_schema", "{"))),
            drain("grammar", greedy(10, structured=good))), 60)

    try:
        results = asyncio.run(main())
    finally:
        front.shutdown()
    assert results[0] == (10, None) and results[2][1] is None and results[2][0] >= 1
    assert isinstance(results[1][1], RequestError) and "does not compile" in str(results[1][1])
    assert front.error is None


def test_the_async_front_compiles_off_the_engine_thread(tiny_gguf, monkeypatch):
    """A new spec is compiled on a worker thread before its request reaches the engine, whose thread runs every
    stream's steps; the engine then finds it in the cache."""
    import threading

    from tailguard.engine.structured import GrammarCompiler

    threads: list[str] = []
    real = GrammarCompiler._compile

    def spy(self, so):
        threads.append(threading.current_thread().name)
        return real(self, so)

    monkeypatch.setattr(GrammarCompiler, "_compile", spy)
    front = AsyncLLMEngine(_build(tiny_gguf, "torch"))

    async def main():
        return [ev async for ev in front.generate([1, 2, 3], greedy(8, structured=StructuredOutput(
            "regex", "(off|the|engine| )+")), "s")]

    try:
        events = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        front.shutdown()
    assert events[-1].finished and re.fullmatch("(off|the|engine| )+", "".join(ev.text for ev in events))
    assert len(threads) == 1 and threads[0] != "tailguard-engine"


def test_a_grammar_failure_mid_request_ends_that_request_alone(engines, monkeypatch):
    engine = engines["torch"]
    so = StructuredOutput("regex", "[a-z ]{0,100}")
    engine.add_request([3, 4, 5], greedy(10, structured=so), "left")
    engine.add_request([3, 4, 5], greedy(10, structured=so), "bad")
    state = engine._tracked["bad"].seq.logits_state
    assert state is not None
    target = state.matcher
    real = GrammarMatcher.advance

    def broken(self, token_id):
        if self is target:
            raise ValueError("injected matcher failure")
        return real(self, token_id)

    monkeypatch.setattr(GrammarMatcher, "advance", broken)
    events: dict[str, list] = {}
    while engine.has_unfinished():
        for ev in engine.step():
            events.setdefault(ev.request_id, []).append(ev)
    bad = events["bad"][-1]
    assert bad.request_failed and "injected matcher failure" in (bad.error or "")
    assert events["left"][-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP) and not events["left"][-1].error
    assert engine.pool.num_used == 0 and not engine._tracked


def test_the_async_front_raises_sequence_failed_for_a_grammar_failure(tiny_gguf, monkeypatch):
    engine = _build(tiny_gguf, "torch")

    def broken(self, token_id):
        raise ValueError("injected")

    monkeypatch.setattr(GrammarMatcher, "advance", broken)
    front = AsyncLLMEngine(engine)

    async def main():
        got = []
        with pytest.raises(SequenceFailed):
            async for ev in front.generate([1, 2, 3], greedy(5, structured=StructuredOutput("regex", "x+")), "g"):
                got.append(ev)
        plain = [ev async for ev in front.generate([1, 2, 3], greedy(5), "p")]
        return plain

    try:
        plain = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        front.shutdown()
    assert plain[-1].finish_reason is FinishReason.LENGTH


# --- speculative decoding -------------------------------------------------------------------------------------------


def test_requests_with_these_features_never_speculate(tiny_gguf):
    spec = _build(tiny_gguf, "torch", speculative="ngram", speculative_max_running=32, kv_cache_dtype="float32")
    ref = _build(tiny_gguf, "torch", kv_cache_dtype="float32")
    # Prompts that repeat themselves: prompt lookup has plenty to propose.
    rng = random.Random(3)
    ps = [[rng.randrange(100, 49000) for _ in range(6)] * 4 for _ in range(4)]
    params = [greedy(24, frequency_penalty=0.5), greedy(24, logit_bias={77: 1.0}), greedy(24, repetition_penalty=1.2),
              greedy(24, structured=StructuredOutput("regex", "[a-z ]{0,80}"))]
    items = [(p, sp) for p in ps for sp in params]
    got = run(spec, items)
    assert all(ev[-1].num_spec_proposed == 0 for ev in got)
    assert [tokens(ev) for ev in got] == [tokens(ev) for ev in run(ref, items)]
    plain = run(spec, [(p, greedy(48)) for p in prompts(12, seed=0)])  # the others still speculate (greedy loops)
    assert sum(ev[-1].num_spec_proposed for ev in plain) > 0


# --- the real model -------------------------------------------------------------------------------------------------

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "minLength": 1, "maxLength": 32},
        "role": {"type": "string", "enum": ["engineer", "teacher", "doctor", "artist", "student", "other"]},
        "skills": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 24},
                   "minItems": 1, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"street": {"type": "string", "maxLength": 40},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "zip"], "additionalProperties": False},
        "remote": {"type": ["boolean", "null"]},
    },
    "required": ["name", "age", "city", "role", "skills", "address", "remote"],
    "additionalProperties": False,
}
_FIRST = ["Maria", "Tom", "Aiko", "Jonas", "Chloe", "Rafael", "Emma", "Noah", "Sofia", "Liam", "Mei", "Oliver", "Ana"]
_CITY = ["Seattle", "Leeds", "Osaka", "Berlin", "Lyon", "Recife", "Austin", "Toronto", "Milan", "Dublin"]
_JOB = ["software engineer", "history teacher", "surgeon", "painter", "student", "baker", "pilot"]


def person_prompts(n: int) -> list[str]:
    rng = random.Random(50)
    out = []
    for i in range(n):
        who = (f"{rng.choice(_FIRST)}, a {rng.randint(18, 80)}-year-old {rng.choice(_JOB)} from {rng.choice(_CITY)}"
               f" who likes {rng.choice(['chess', 'hiking', 'cooking', 'jazz', 'running'])}")
        style = ["Describe this person as JSON", "Give me a JSON record for", "Extract the profile of",
                 "Fill in a JSON profile (name, age, city, role, skills, address, remote) for"][i % 4]
        out.append(f"{style}: {who}.")
    return out


def check_person(doc) -> None:
    """PERSON_SCHEMA by hand (jsonschema is not a dependency)."""
    assert isinstance(doc, dict) and set(doc) == set(PERSON_SCHEMA["required"]), doc
    assert isinstance(doc["name"], str) and 1 <= len(doc["name"]) <= 32
    assert isinstance(doc["age"], int) and not isinstance(doc["age"], bool) and 0 <= doc["age"] <= 120
    assert isinstance(doc["city"], str) and 1 <= len(doc["city"]) <= 32
    assert doc["role"] in PERSON_SCHEMA["properties"]["role"]["enum"]
    assert isinstance(doc["skills"], list) and 1 <= len(doc["skills"]) <= 3
    assert all(isinstance(s, str) and 1 <= len(s) <= 24 for s in doc["skills"])
    addr = doc["address"]
    assert isinstance(addr, dict) and set(addr) == {"street", "zip"} and isinstance(addr["street"], str)
    assert len(addr["street"]) <= 40 and re.fullmatch(r"[0-9]{5}", addr["zip"])
    assert doc["remote"] is None or isinstance(doc["remote"], bool)


@pytest.mark.real_model
@pytest.mark.slow
def test_real_model_json_schema_output_parses_and_validates(real_engine, tokenizer):
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    so = StructuredOutput("json_schema", json.dumps(PERSON_SCHEMA))
    texts = person_prompts(52)
    items = [(tokenizer.encode_chat([{"role": "user", "content": t}]),
              SamplingParams(max_tokens=256, temperature=0 if i % 2 else 0.7, seed=i, structured=so))
             for i, t in enumerate(texts)]
    results = run(real_engine, items)
    for events in results:
        text = "".join(ev.text for ev in events)
        assert events[-1].finish_reason is FinishReason.STOP, text
        doc = json.loads(text)
        check_person(doc)
        if jsonschema is not None:
            jsonschema.validate(doc, PERSON_SCHEMA)


@pytest.mark.real_model
@pytest.mark.parametrize("how", ["exact", "regex_prefix", "lark_prefix"])
def test_real_model_grammar_equals_unconstrained_greedy_where_that_fits(real_engine, tokenizer, how):
    questions = ["What is the capital of France?", "Name three colors of the rainbow.",
                 "Write one sentence about the sea."]
    for q in questions:
        prompt = tokenizer.encode_chat([{"role": "user", "content": q}])
        (plain_events,) = run(real_engine, [(prompt, SamplingParams(max_tokens=24, temperature=0))])
        plain = tokens(plain_events)
        body = [t for t in plain if t not in real_engine.stop_ids]
        text = tokenizer.decode(body)
        assert text and "\ufffd" not in text
        if how == "exact":
            so = StructuredOutput("regex", regex_literal(text))
        elif how == "regex_prefix":
            so = StructuredOutput("regex", regex_literal(text) + r"[\s\S]*")
        else:
            so = StructuredOutput("grammar", f"start: PREFIX REST\nPREFIX: {json.dumps(text)}\nREST: /(.|\\n)*/")
        (events,) = run(real_engine, [(prompt, SamplingParams(max_tokens=24, temperature=0, structured=so))])
        if how == "exact":  # the grammar is complete after the text: it ends there, EOS or no EOS
            assert tokens(events) == body and events[-1].finish_reason is FinishReason.STOP
        else:
            assert tokens(events) == plain and events[-1].finish_reason is plain_events[-1].finish_reason
