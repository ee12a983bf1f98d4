"""What users of the embedded engine expect from the API, through the official ``openai`` client: penalties and
``logit_bias`` with an effect, JSON mode and JSON schemas that parse and validate, and tool calling (``tool_choice``
required, named and auto; streamed and not) in OpenAI's shape. Mechanics on the tiny random-weight model (a grammar
holds whatever the weights); answers that must make sense on the real model."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tailguard.engine.model_store import ModelNotFoundError, resolve_model_path
from tests.serving_helpers import make_config, tiny_engine

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 32},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24},
                                                       "maxItems": 3}},
          "required": ["name", "age", "hobbies"], "additionalProperties": False}


def _model(name: str):
    try:
        resolve_model_path("smollm2")  # the tiny model borrows the real model's tokenizer
    except ModelNotFoundError as exc:
        pytest.skip(f"model not available: {exc}")
    from tailguard.engine.engine import AsyncLLMEngine, EngineArgs

    if name == "tiny":
        return tiny_engine()
    return AsyncLLMEngine.from_args(EngineArgs(model="smollm2", kv_cache_tokens=16384, max_num_seqs=16,
                                               max_num_batched_tokens=512))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tailguard.serving.server import ThreadedServer

    with ThreadedServer(make_config(tmp_path_factory.mktemp("tiny"), model="tiny"), _model("tiny")) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_neutral_penalties_change_nothing_and_a_bias_takes_over(tiny):
    kw = dict(model="tiny", messages=_ask("Hello there"), max_tokens=8, temperature=0,
              extra_body={"ignore_eos": True})
    plain = tiny.chat.completions.create(**kw).choices[0].message.content
    neutral = tiny.chat.completions.create(**kw, presence_penalty=0, frequency_penalty=0, logit_bias={})
    assert neutral.choices[0].message.content == plain
    forced = tiny.chat.completions.create(**kw, logit_bias={"28": 100}).choices[0].message.content
    assert forced == forced[0] * 8 and forced != plain  # token 28 (",") everywhere


def test_a_frequency_penalty_cuts_repeats(tiny):
    def distinct(**extra):
        text = tiny.completions.create(model="tiny", prompt="a a a a", max_tokens=48, temperature=0,
                                       extra_body={"ignore_eos": True}, **extra).choices[0].text
        return len(set(text.split())), text

    base, _ = distinct()
    penalised, _ = distinct(frequency_penalty=2.0, presence_penalty=2.0)
    assert penalised > base  # the random model loops; penalised, it cannot keep repeating itself
    repeated = tiny.completions.create(model="tiny", prompt="a a a a", max_tokens=48, temperature=0,
                                       extra_body={"ignore_eos": True, "repetition_penalty": 1.3}).choices[0].text
    assert len(set(repeated.split())) > base


def test_json_mode_and_a_schema_hold_on_the_tiny_model(tiny):
    out = tiny.chat.completions.create(model="tiny", messages=_ask("JSON please"), max_tokens=64, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "person", "schema": PERSON}})
    if out.choices[0].finish_reason == "stop":  # a random model may run out of tokens mid-document
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    assert out.choices[0].message.content.startswith("{")
    obj = tiny.chat.completions.create(model="tiny", messages=_ask("JSON"), max_tokens=64, temperature=0,
                                       response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_tool_calls_come_back_in_openais_shape(tiny, stream, choice):
    kw = dict(model="tiny", messages=_ask("What time is it?"), tools=TOOLS, tool_choice=choice, max_tokens=128,
              temperature=0)
    if stream:
        calls, finish = {}, None
        for chunk in tiny.chat.completions.create(**kw, stream=True):
            for ch in chunk.choices:
                for tc in ch.delta.tool_calls or ():
                    calls[tc.index] = tc
                finish = ch.finish_reason or finish
        call = calls[0]
    else:
        out = tiny.chat.completions.create(**kw)
        finish, call = out.choices[0].finish_reason, out.choices[0].message.tool_calls[0]
        assert out.choices[0].message.content is None
    assert finish == "tool_calls" and call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    if isinstance(choice, dict):
        assert call.function.name == "get_time" and args["zone"] in ("UTC", "CET")
    else:
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(args, schema)


def test_a_schema_past_the_grammar_engines_limits_is_the_clients_400_and_the_server_goes_on(tiny):
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}
    fmt = {"type": "json_schema", "json_schema": {"name": "wide", "schema": wide}}
    with pytest.raises(openai.BadRequestError) as err:  # its first key passes 2,000 Earley items in a row
        tiny.chat.completions.create(model="tiny", messages=_ask("JSON"), max_tokens=16, temperature=0,
                                     response_format=fmt, logit_bias={"39428": 100})  # '{"'
    assert err.value.body["code"] == "grammar_too_complex"
    assert "grammar engine's limits" in err.value.body["message"] and "\n" not in err.value.body["message"]
    out = tiny.chat.completions.create(model="tiny", messages=_ask("JSON"), max_tokens=8, temperature=0,
                                       response_format={"type": "json_object"})
    assert out.choices[0].message.content.startswith("{")


def test_tools_refused_by_name_when_they_cannot_be_honoured(tiny):
    with pytest.raises(openai.BadRequestError) as err:
        tiny.chat.completions.create(model="tiny", messages=_ask("x"), tools=TOOLS,
                                     tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as err:
        tiny.chat.completions.create(model="tiny", messages=_ask("x"), n=17)  # more choices than one request may ask
    assert err.value.body["param"] == "n"


@pytest.mark.real_model
def test_json_schema_answers_of_the_real_model_parse_and_validate_on_50_prompts(tmp_path):
    from tailguard.serving.server import ThreadedServer

    topics = ["a chef", "a pilot", "a painter", "a teacher", "a sailor", "a nurse", "a poet", "a farmer",
              "a dancer", "a coder"]
    prompts = [f"Invent {t} number {i}: give their name, age and hobbies." for i in range(5) for t in topics]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    with ThreadedServer(make_config(tmp_path, model="smollm2"), _model("smollm2")) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=300)

        def one(prompt: str):
            return client.chat.completions.create(model="smollm2", messages=_ask(prompt), max_tokens=128,
                                                  temperature=0.7, seed=len(prompt), response_format=fmt)

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(one, prompts))
        call = client.chat.completions.create(model="smollm2", messages=_ask("What's the weather in Paris?"),
                                              tools=TOOLS, tool_choice="required", max_tokens=96, temperature=0)
    for a in answers:
        assert a.choices[0].finish_reason == "stop", a.choices[0].message.content
        jsonschema.validate(json.loads(a.choices[0].message.content), PERSON)
    tc = call.choices[0].message.tool_calls[0]
    assert call.choices[0].finish_reason == "tool_calls" and tc.function.name in ("get_weather", "get_time")
    jsonschema.validate(json.loads(tc.function.arguments),
                        next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == tc.function.name))
