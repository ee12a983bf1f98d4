#!/usr/bin/env python
"""Structured output (grammar-constrained decoding): what the token mask costs, and what it costs end to end.

``masks``: llguidance against xgrammar at SmolLM2's vocabulary (49,152 tokens) on this CPU, for a realistic JSON
schema (an order: nested objects, an enum, an array of objects, a pattern, a nullable field) and a tool-call schema
(one of three tools, each with its own arguments), all in the engine's JSON format (json.dumps' separators, no free
whitespace). Three configurations: "llguidance" as the engine compiles for it (engine/structured.py: no_forcing, so
that the mask is exact and greedy under a grammar keeps the model's own tokens), "llguidance-forcing" (llguidance's
default: text the grammar fixes is forced as its canonical tokens, one allowed token at a time) and "xgrammar" (its
mask is exact). For each: the import (seconds, resident MiB, whether torch comes with it), the one-time tokenizer
set-up, the compile time of each schema (cold: no cache), the first mask after it, and the per-token mask time along
real token trajectories (16 valid documents, tokenized by the engine's tokenizer, EOS last): one stream at a time,
and 16 matchers at staggered positions each step (a stream that ends starts again: the batch stays full), both one by
one and with the library's parallel batch call (llguidance's LLExecutor, xgrammar's BatchGrammarMatcher; 2 threads on
this 2-core machine). Rounds alternate the libraries so that load on the shared machine hits all alike; medians and
P99 are over every round's tokens.

``e2e``: decode tokens/s of the real model (the default native runner) with and without a JSON schema, one stream
and 16 streams, greedy, arms alternated (plain, schema, plain, schema, ... and the order flipped each round), medians
and the ratio schema/plain; and the grammar's own time inside the steps (the sampler's work per token, how often the
full mask was needed, the matcher's advance).

xgrammar imports torch and transformers and asks pip for triton, so it is not installed in .venv; the ``masks``
numbers were taken in a scratch virtual environment holding both libraries (python3 -m venv /tmp/sovenv; pip install
llguidance==1.9.1 numpy tokenizers jinja2 gguf pydantic; the local CPU torch 2.13.0 wheel and xgrammar==0.2.9 with
--no-deps, then apache-tvm-ffi, sympy, networkx and transformers with torch==2.13.0 as a constraint):

    PYTHONPATH=src /tmp/sovenv/bin/python benchmarks/structured_output.py masks
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/structured_output.py e2e --reps 7

Each part updates its own section of benchmarks/results/structured_output.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "structured_output.json"
VOCAB = 49152  # set from the tokenizer
STEPS_16 = 150  # steps of 16 concurrent matchers per round

ORDER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "email": {"type": "string"},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string"},
                        "city": {"type": "string"},
                        "country": {"type": "string", "enum": ["US", "CA", "GB", "DE", "FR", "JP", "BR"]},
                        "postal_code": {"type": "string"},
                    },
                    "required": ["street", "city", "country", "postal_code"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "email", "address"],
            "additionalProperties": False,
        },
        "status": {"type": "string", "enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "name": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "unit_price": {"type": "number"},
                },
                "required": ["sku", "name", "quantity", "unit_price"],
                "additionalProperties": False,
            },
            "minItems": 1,
        },
        "gift": {"type": "boolean"},
        "notes": {"type": ["string", "null"]},
    },
    "required": ["order_id", "customer", "status", "items", "gift", "notes"],
    "additionalProperties": False,
}


def _tool(name: str, arguments: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"const": name},
            "arguments": {"type": "object", "properties": arguments, "required": required,
                          "additionalProperties": False},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


TOOL_CALL_SCHEMA: dict[str, Any] = {
    "anyOf": [
        _tool("get_weather", {"location": {"type": "string"},
                              "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["location", "unit"]),
        _tool("search_web", {"query": {"type": "string"},
                             "max_results": {"type": "integer", "minimum": 1, "maximum": 20}}, ["query", "max_results"]),
        _tool("send_email", {"to": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                             "subject": {"type": "string"}, "body": {"type": "string"}}, ["to", "subject", "body"]),
    ]
}

SCHEMAS = {"order": ORDER_SCHEMA, "tool_call": TOOL_CALL_SCHEMA}

_NAMES = ["Maria Lopez", "John Smith", "Aiko Tanaka", "Lukas Weber", "Chloe Martin", "Rafael Souza", "Emma Brown",
          "Noah Wilson", "Sofia Rossi", "Liam O'Brien", "Mei Chen", "Oliver Jones", "Ana Costa", "Jonas Becker"]
_CITIES = [("Seattle", "US"), ("Toronto", "CA"), ("London", "GB"), ("Berlin", "DE"), ("Lyon", "FR"),
           ("Osaka", "JP"), ("Recife", "BR"), ("Austin", "US"), ("Munich", "DE")]
_PRODUCTS = ["wireless mouse", "USB-C cable (2 m)", "mechanical keyboard", "27\" monitor", "laptop stand",
             "noise-cancelling headphones", "webcam", "desk lamp"]


def order_example(rng: random.Random) -> dict[str, Any]:
    name = rng.choice(_NAMES)
    city, country = rng.choice(_CITIES)
    items = [{"sku": f"SKU-{rng.randrange(10000, 99999)}", "name": rng.choice(_PRODUCTS),
              "quantity": rng.randint(1, 5), "unit_price": round(rng.uniform(3, 400), 2)}
             for _ in range(rng.randint(1, 4))]
    return {
        "order_id": f"ORD-{rng.randrange(10**6):06d}",
        "customer": {"name": name, "email": name.lower().replace(" ", ".").replace("'", "") + "@example.com",
                     "address": {"street": f"{rng.randint(1, 999)} {rng.choice(['Main', 'Oak', 'Pine'])} Street",
                                 "city": city, "country": country, "postal_code": str(rng.randrange(10000, 99999))}},
        "status": rng.choice(["pending", "paid", "shipped", "delivered", "cancelled"]),
        "items": items,
        "gift": rng.random() < 0.3,
        "notes": rng.choice([None, "Leave at the door.", "Please call before delivery, the bell is broken."]),
    }


def tool_call_example(rng: random.Random) -> dict[str, Any]:
    kind = rng.randrange(3)
    if kind == 0:
        return {"name": "get_weather", "arguments": {"location": rng.choice(_CITIES)[0],
                                                     "unit": rng.choice(["celsius", "fahrenheit"])}}
    if kind == 1:
        return {"name": "search_web", "arguments": {"query": f"best {rng.choice(_PRODUCTS)} under $100 reviews",
                                                    "max_results": rng.randint(1, 20)}}
    return {"name": "send_email", "arguments": {
        "to": [rng.choice(_NAMES).lower().replace(" ", ".").replace("'", "") + "@example.com"
               for _ in range(rng.randint(1, 3))],
        "subject": "Your order has shipped",
        "body": f"Hi {rng.choice(_NAMES).split()[0]}, your {rng.choice(_PRODUCTS)} is on its way and should arrive "
                "within three business days. Thanks for shopping with us!"}}


EXAMPLES = {"order": order_example, "tool_call": tool_call_example}


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def summary_us(values_ns: list[int]) -> dict[str, float]:
    us = [v / 1000 for v in values_ns]
    return {"median_us": round(statistics.median(us), 1), "p99_us": round(pct(us, 99), 1),
            "max_us": round(max(us), 1), "n": len(us)}


# --- the two libraries behind one interface -------------------------------------------------------------------------
class LLGuidanceLib:
    """llguidance as the engine compiles for it (engine/structured.py: compact JSON, no_forcing), or, with
    ``forcing``, with llguidance's default of forcing the canonical tokens of text the grammar fixes."""

    name = "llguidance"
    forcing = False

    def __init__(self, tokenizer: Any) -> None:
        import llguidance
        import llguidance.numpy as llg_np

        self.llg, self.np_api = llguidance, llg_np
        t0 = time.perf_counter()
        self.tok = llguidance.LLTokenizer(tokenizer._tok.to_str(), n_vocab=tokenizer.vocab_size,
                                          eos_token=sorted(tokenizer.stop_token_ids))
        self.setup_s = time.perf_counter() - t0
        self.executor = llguidance.LLExecutor(num_threads=2)
        self.version = llguidance.get_version() if hasattr(llguidance, "get_version") else "?"

    def compile(self, schema: dict[str, Any]) -> Any:
        from tailguard.engine.structured import JSON_DEFAULTS, GrammarCompiler, StructuredOutput

        if self.forcing:
            grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_DEFAULTS)
        else:
            grammar = GrammarCompiler._grammar(self.llg, StructuredOutput("json_schema", json.dumps(schema)))
        err = self.llg.LLMatcher.validate_grammar(grammar, self.tok)
        if err:
            raise ValueError(err)
        return grammar

    def matcher(self, compiled: Any) -> Any:
        m = self.llg.LLMatcher(self.tok, compiled, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(self, m: Any, bitmask: Any, row: int) -> None:
        self.np_api.fill_next_token_bitmask(m, bitmask, row)

    def fill_batch(self, ms: list[Any], bitmask: Any) -> None:
        self.np_api.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], bitmask)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.consume_token(token)) and not m.is_error()

    def finished(self, m: Any) -> bool:
        return bool(m.is_stopped())


class LLGuidanceForcingLib(LLGuidanceLib):
    name = "llguidance-forcing"
    forcing = True


class XGrammarLib:
    name = "xgrammar"

    def __init__(self, tokenizer: Any) -> None:
        import xgrammar

        self.xgr = xgrammar
        t0 = time.perf_counter()
        # Special tokens (<|im_start|>, ...) as empty strings: xgrammar never allows those inside the grammar's text.
        vocab = ["" if i in tokenizer.special_ids and i not in tokenizer.stop_token_ids else t
                 for i, t in enumerate(tokenizer.tokens)]
        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.BYTE_LEVEL, vocab_size=tokenizer.vocab_size,
                                      stop_token_ids=sorted(tokenizer.stop_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.setup_s = time.perf_counter() - t0
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=2)
        from importlib.metadata import version

        self.version = version("xgrammar")

    def compile(self, schema: dict[str, Any]) -> Any:
        # The engine's JSON format: json.dumps' separators, no other whitespace (xgrammar's mask is exact: it
        # never forces a tokenization).
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any, bitmask: Any, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, ms: list[Any], bitmask: Any) -> None:
        self.batch.batch_fill_next_token_bitmask(ms, bitmask)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.accept_token(token))

    def finished(self, m: Any) -> bool:
        return bool(m.is_terminated())


LIBS = {"llguidance": LLGuidanceLib, "llguidance-forcing": LLGuidanceForcingLib, "xgrammar": XGrammarLib}
MODULES = {"llguidance": "llguidance", "llguidance-forcing": "llguidance", "xgrammar": "xgrammar"}


def _allowed(bitmask: Any, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token >> 5]) >> (token & 31)) & 1)


def one_round(lib: Any, schema: dict[str, Any], docs: list[list[int]], out: dict[str, list]) -> None:
    """Compile (cold), then walk every document alone, then all 16 at once (one by one, and batched)."""
    import numpy as np

    words = (VOCAB + 31) // 32
    t0 = time.perf_counter_ns()
    compiled = lib.compile(schema)
    m = lib.matcher(compiled)
    out["compile"].append(time.perf_counter_ns() - t0)
    bitmask = np.full((16, words), -1, dtype=np.int32)
    t0 = time.perf_counter_ns()
    lib.fill(m, bitmask, 0)
    out["first_mask"].append(time.perf_counter_ns() - t0)
    # One stream at a time.
    for doc in docs:
        m = lib.matcher(compiled)
        for tok in doc:
            t0 = time.perf_counter_ns()
            lib.fill(m, bitmask, 0)
            out["single"].append(time.perf_counter_ns() - t0)
            if not _allowed(bitmask, 0, tok) or not lib.accept(m, tok):
                raise AssertionError(f"{lib.name} refused token {tok} of a valid document")
        if not lib.finished(m):
            raise AssertionError(f"{lib.name}: the document ended but the grammar did not")
    # 16 concurrent streams, staggered (stream i starts 5*i tokens into its document), for STEPS_16 steps: a stream
    # that ends its document starts it again with a new matcher (continuous batching keeps the batch full).
    for mode in ("seq16", "batch16"):
        ms = [lib.matcher(compiled) for _ in docs]
        pos = [0] * len(docs)
        for i, (mm, doc) in enumerate(zip(ms, docs)):
            for tok in doc[: (5 * i) % (len(doc) - 1)]:
                lib.accept(mm, tok)
                pos[i] += 1
        for _ in range(STEPS_16):
            t0 = time.perf_counter_ns()
            if mode == "batch16":
                lib.fill_batch(ms, bitmask)
            else:
                for row, mm in enumerate(ms):
                    lib.fill(mm, bitmask, row)
            out[mode].append(time.perf_counter_ns() - t0)
            for row, doc in enumerate(docs):
                tok = doc[pos[row]]
                if not _allowed(bitmask, row, tok) or not lib.accept(ms[row], tok):
                    raise AssertionError(f"{lib.name} ({mode}) refused token {tok}")
                pos[row] += 1
                if pos[row] == len(doc):
                    ms[row], pos[row] = lib.matcher(compiled), 0


def import_cost(module: str) -> dict[str, float]:
    """What importing the library costs a fresh interpreter: seconds, and resident MiB added (numpy already in)."""
    import subprocess
    import sys

    # Resident memory from /proc (ru_maxrss would carry this process's high-water mark over into the child).
    code = ("import time, numpy\n"
            "def rss(): return int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0])\n"
            f"r0 = rss(); t0 = time.perf_counter(); import {module}; t = time.perf_counter() - t0\n"
            "import sys; print(t, (rss() - r0) / 1024, 'torch' in sys.modules)")
    runs = []
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
        runs.append((float(out[0]), float(out[1]), out[2] == "True"))
    return {"import_s": round(statistics.median(r[0] for r in runs), 3),
            "import_rss_mib": round(statistics.median(r[1] for r in runs), 1), "imports_torch": runs[0][2]}


def bench_masks(args: argparse.Namespace) -> dict[str, Any]:
    from tailguard.engine.model_store import resolve_model_path
    from tailguard.engine.tokenizer import GGUFTokenizer

    global VOCAB
    tokenizer = GGUFTokenizer(resolve_model_path("smollm2"))
    VOCAB = tokenizer.vocab_size
    eos = tokenizer.eos_token_id
    libs = {}
    for name in args.libs.split(","):
        try:
            libs[name] = LIBS[name](tokenizer)
        except ImportError as exc:
            print(f"{name}: not importable here ({exc}); skipped")
    docs = {}
    for sname, make in EXAMPLES.items():
        rng = random.Random(7)
        docs[sname] = [tokenizer.encode(json.dumps(make(rng))) + [eos] for _ in range(16)]
    raw: dict[str, dict[str, dict[str, list]]] = {
        ln: {s: {k: [] for k in ("compile", "first_mask", "single", "seq16", "batch16")} for s in SCHEMAS}
        for ln in libs}
    for r in range(args.rounds):
        order = list(libs) if r % 2 == 0 else list(reversed(libs))
        for ln in order:
            for sname, schema in SCHEMAS.items():
                one_round(libs[ln], schema, docs[sname], raw[ln][sname])
        print(f"round {r + 1}/{args.rounds} done")
    result: dict[str, Any] = {"vocab_size": VOCAB, "cpu_count": os.cpu_count(), "rounds": args.rounds,
                              "documents": {s: {"count": len(d), "tokens": sum(map(len, d))} for s, d in docs.items()},
                              "libraries": {}}
    for ln, lib in libs.items():
        entry: dict[str, Any] = {"version": lib.version, "tokenizer_setup_ms": round(lib.setup_s * 1000, 1),
                                 **import_cost(MODULES[ln])}
        for sname in SCHEMAS:
            d = raw[ln][sname]
            entry[sname] = {
                "compile_ms": round(statistics.median(d["compile"]) / 1e6, 2),
                "first_mask_us": round(statistics.median(d["first_mask"]) / 1e3, 1),
                "single_stream_per_token": summary_us(d["single"]),
                "16_streams_one_by_one_per_step": summary_us(d["seq16"]),
                "16_streams_batched_per_step": summary_us(d["batch16"]),
            }
        result["libraries"][ln] = entry
    print_masks(result)
    return result


def print_masks(result: dict[str, Any]) -> None:
    print(f"\nmask cost at a {result['vocab_size']:,}-token vocabulary, {result['cpu_count']} CPUs "
          f"({result['rounds']} rounds; per-token = one mask; per-step = 16 masks)")
    head = (f"{'library':<18} {'schema':<10} {'setup ms':>8} {'compile ms':>10} {'1st mask us':>11} "
            f"{'1 stream med/p99 us':>20} {'16 one-by-one med/p99 us':>25} {'16 batched med/p99 us':>22}")
    print(head)
    print("-" * len(head))
    for ln, e in result["libraries"].items():
        print(f"{ln} {e['version']}: import {e['import_s']:.2f} s, +{e['import_rss_mib']:.0f} MiB resident, "
              f"imports torch: {e['imports_torch']}")
    for ln, e in result["libraries"].items():
        for sname in SCHEMAS:
            s = e[sname]
            one, seq, bat = (s["single_stream_per_token"], s["16_streams_one_by_one_per_step"],
                             s["16_streams_batched_per_step"])
            print(f"{ln:<18} {sname:<10} {e['tokenizer_setup_ms']:>8.0f} {s['compile_ms']:>10.2f} "
                  f"{s['first_mask_us']:>11.0f} {one['median_us']:>9.1f} / {one['p99_us']:>8.1f} "
                  f"{seq['median_us']:>12.0f} / {seq['p99_us']:>10.0f} {bat['median_us']:>10.0f} / {bat['p99_us']:>9.0f}")


# --- end to end: the real model with and without a JSON schema ------------------------------------------------------
# The order schema with at least 20 items: no document completes within max_tokens, so both arms generate the same
# number of tokens per request and the schema arm pays its masks on every one of them.
LONG_ORDER_SCHEMA: dict[str, Any] = json.loads(json.dumps(ORDER_SCHEMA))
LONG_ORDER_SCHEMA["properties"]["items"]["minItems"] = 20
E2E_PROMPTS = [
    f"Write the JSON record of an online order by {name} from {city}: {n} items, including a {product}."
    for name, (city, _), n, product in zip(_NAMES * 2, _CITIES * 2, [3, 5, 2, 4, 6, 1, 3, 2] * 2, _PRODUCTS * 2)
][:16]


def _run(engine: Any, prompts: list[list[int]], sp: Any,
         full_steps: list[float] | None = None) -> tuple[list[list[Any]], float]:
    """Run prompts together: each one's events, and the wall time from the first token to the last. ``full_steps``
    collects the duration of every step in which every request decoded a token (the steady state)."""
    from tailguard.engine.sequence import SamplingParams

    ids = [engine.add_request(p, SamplingParams(**vars(sp))) for p in prompts]
    events: dict[str, list[Any]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        t0 = time.perf_counter()
        step = engine.step()
        took = time.perf_counter() - t0
        if full_steps is not None and len(step) == len(ids) and all(len(events[ev.request_id]) for ev in step):
            full_steps.append(took)
        for ev in step:
            events[ev.request_id].append(ev)
    out = [events[rid] for rid in ids]
    return out, max(ev[-1].time for ev in out) - min(ev[0].time for ev in out)


def _decode_rate(events: list[Any]) -> float:
    times = [ev.time for ev in events if ev.token_id is not None]
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0


class _Clock:
    """Time spent in the grammar's work inside the engine's steps (masks and the logits transform; matcher
    advances), by wrapping the methods the engine calls."""

    def __init__(self) -> None:
        from tailguard.engine.sampling import LogitsState
        from tailguard.engine.structured import GrammarMatcher

        self.greedy_ns: list[int] = []  # greedy_token: the whole per-token work of a greedy request's logits
        self.process_ns: list[int] = []  # process: the full mask, only where the row's argmax was refused
        self.advance_ns: list[int] = []
        self._patches = [(LogitsState, "greedy_token", self.greedy_ns), (LogitsState, "process", self.process_ns),
                         (GrammarMatcher, "advance", self.advance_ns)]
        self._orig = [getattr(cls, name) for cls, name, _ in self._patches]

    def __enter__(self) -> _Clock:
        for (cls, name, sink), orig in zip(self._patches, self._orig):
            def timed(*a: Any, _orig: Any = orig, _sink: list[int] = sink, **k: Any) -> Any:
                t0 = time.perf_counter_ns()
                try:
                    return _orig(*a, **k)
                finally:
                    _sink.append(time.perf_counter_ns() - t0)
            setattr(cls, name, timed)
        return self

    def __exit__(self, *exc: Any) -> None:
        for (cls, name, _), orig in zip(self._patches, self._orig):
            setattr(cls, name, orig)


def bench_e2e(args: argparse.Namespace) -> dict[str, Any]:
    from tailguard.engine.engine import EngineArgs, LLMEngine
    from tailguard.engine.sequence import FinishReason, SamplingParams
    from tailguard.engine.structured import StructuredOutput

    engine = LLMEngine(EngineArgs(model="smollm2", num_threads=args.threads, kv_cache_tokens=16384,
                                  max_num_seqs=32))
    tok = engine.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in E2E_PROMPTS]
    schema = StructuredOutput("json_schema", json.dumps(LONG_ORDER_SCHEMA))
    arms = {
        "plain": SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True),
        "json_schema": SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True, structured=schema),
    }
    for sp in arms.values():  # warm-up: weights paged in, the schema compiled, kernels' per-shape state built
        _run(engine, prompts[:2], sp)
    load_start = os.getloadavg()[0]
    t0 = time.perf_counter()
    single: dict[str, list[float]] = {a: [] for a in arms}
    multi: dict[str, list[float]] = {a: [] for a in arms}
    # Every steady-state step's duration (all requests decoding): its median is the per-token cost with the
    # other tenants' preemptions filtered out, where a whole run's throughput takes them all in.
    steps: dict[str, dict[str, list[float]]] = {"single": {a: [] for a in arms}, "multi": {a: [] for a in arms}}
    reasons: set[str] = set()
    clock = _Clock()
    for rep in range(args.reps):
        order = list(arms) if rep % 2 == 0 else list(reversed(arms))
        for prompt in prompts[: args.single_prompts]:
            for arm in order:  # the two arms of a pair back to back: their ratio sees the same load
                with clock if arm == "json_schema" else _nullcontext():
                    [events], _ = _run(engine, [prompt], arms[arm], steps["single"][arm])
                single[arm].append(_decode_rate(events))
                reasons.add(f"{arm}:{events[-1].finish_reason}")
        for arm in order:
            with clock if arm == "json_schema" else _nullcontext():
                results, wall = _run(engine, prompts[: args.streams], arms[arm], steps["multi"][arm])
            multi[arm].append(sum(sum(ev.token_id is not None for ev in r) for r in results) / wall)
            reasons.update(f"{arm}:{r[-1].finish_reason}" for r in results)
        print(f"  round {rep + 1}/{args.reps}: single {statistics.median(single['plain']):.1f} vs "
              f"{statistics.median(single['json_schema']):.1f} tok/s; {args.streams} streams "
              f"{multi['plain'][-1]:.1f} vs {multi['json_schema'][-1]:.1f} tok/s", flush=True)
    assert reasons <= {f"plain:{FinishReason.LENGTH}", f"json_schema:{FinishReason.LENGTH}"}, reasons
    # Does the schema arm's output hold? (Its documents are cut at max_tokens: a prefix of a valid document.)
    s1p, s1s = statistics.median(single["plain"]), statistics.median(single["json_schema"])
    m16p, m16s = statistics.median(multi["plain"]), statistics.median(multi["json_schema"])

    def paired(d: dict[str, list[float]]) -> float:
        """The median of the pairs' ratios schema/plain (each pair run back to back)."""
        return round(statistics.median(s / p for p, s in zip(d["plain"], d["json_schema"])), 3)

    def step_ms(d: dict[str, list[float]], rows: int) -> dict[str, float]:
        p, s_ = statistics.median(d["plain"]), statistics.median(d["json_schema"])
        return {"plain_median_step_ms": round(p * 1e3, 2), "json_schema_median_step_ms": round(s_ * 1e3, 2),
                "plain_tps": round(rows / p, 1), "json_schema_tps": round(rows / s_, 1),
                "ratio_tps": round(p / s_, 3), "steps_per_arm": min(len(d["plain"]), len(d["json_schema"]))}

    result = {
        "model": "smollm2", "weight_format": engine.weight_format, "runner": "native" if engine.native else "torch",
        "threads": args.threads, "max_tokens": args.max_tokens, "reps": args.reps,
        "single_prompts": args.single_prompts, "streams": args.streams,
        "schema": "ORDER_SCHEMA with items.minItems=20 (no document completes within max_tokens)",
        "single_stream": {"plain_tps": round(s1p, 1), "json_schema_tps": round(s1s, 1),
                          "ratio": round(s1s / s1p, 3), "paired_ratio": paired(single),
                          "steady_steps": step_ms(steps["single"], 1), "runs_per_arm": len(single["plain"]),
                          "plain_all": [round(x, 1) for x in single["plain"]],
                          "json_schema_all": [round(x, 1) for x in single["json_schema"]]},
        f"{args.streams}_streams": {"plain_tps": round(m16p, 1), "json_schema_tps": round(m16s, 1),
                                    "ratio": round(m16s / m16p, 3), "paired_ratio": paired(multi),
                                    "steady_steps": step_ms(steps["multi"], args.streams),
                                    "plain_all": [round(x, 1) for x in multi["plain"]],
                                    "json_schema_all": [round(x, 1) for x in multi["json_schema"]]},
        "grammar_time_in_steps": {"choose_token_per_token": summary_us(clock.greedy_ns),
                                  "full_mask_fallback_per_use": summary_us(clock.process_ns or [0]),
                                  "full_mask_fallback_share": round(len(clock.process_ns) / max(1, len(clock.greedy_ns)),
                                                                    3),
                                  "matcher_advance_per_token": summary_us(clock.advance_ns)},
        "seconds": round(time.perf_counter() - t0, 1), "load_average_start": round(load_start, 2),
        "load_average_end": round(os.getloadavg()[0], 2),
    }
    print(f"\nend to end, {result['runner']} runner, {args.threads} threads, {args.max_tokens} tokens a request, "
          f"medians of {args.reps} alternated rounds:")
    print(f"{'':<22} {'plain tok/s':>12} {'json_schema tok/s':>18} {'ratio':>7} {'paired':>7}   "
          f"{'median step: plain ms':>21} {'schema ms':>9} {'ratio tok/s':>11}")
    for label, key, p_, s_ in (("1 stream", "single_stream", s1p, s1s),
                               (f"{args.streams} streams (aggregate)", f"{args.streams}_streams", m16p, m16s)):
        r = result[key]
        st = r["steady_steps"]
        print(f"{label:<22} {p_:>12.1f} {s_:>18.1f} {s_ / p_:>7.3f} {r['paired_ratio']:>7.3f}   "
              f"{st['plain_median_step_ms']:>21.2f} {st['json_schema_median_step_ms']:>9.2f} {st['ratio_tps']:>11.3f}")
    g = result["grammar_time_in_steps"]
    c, f, a = g["choose_token_per_token"], g["full_mask_fallback_per_use"], g["matcher_advance_per_token"]
    print(f"grammar work in the sampler, per token: median {c['median_us']} us (p99 {c['p99_us']}); the full mask was "
          f"needed for {g['full_mask_fallback_share']:.1%} of tokens (median {f['median_us']} us each); matcher "
          f"advance median {a['median_us']} us (p99 {a['p99_us']})")
    return result


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def save(section: str, data: dict[str, Any]) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    current = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    current[section] = data
    RESULTS.write_text(json.dumps(current, indent=2) + "\n")
    print(f"wrote {RESULTS} [{section}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="part", required=True)
    m = sub.add_parser("masks", help="llguidance vs xgrammar: per-token mask cost and compile time")
    m.add_argument("--libs", default="llguidance,llguidance-forcing,xgrammar")
    m.add_argument("--rounds", type=int, default=5)
    m.add_argument("--no-save", action="store_true")
    e = sub.add_parser("e2e", help="decode tokens/s of the real model with and without a JSON schema")
    e.add_argument("--threads", type=int, default=2)
    e.add_argument("--max-tokens", type=int, default=128)
    e.add_argument("--reps", type=int, default=3)
    e.add_argument("--single-prompts", type=int, default=4)
    e.add_argument("--streams", type=int, default=16)
    e.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    result = bench_masks(args) if args.part == "masks" else bench_e2e(args)
    if not args.no_save:
        save(args.part, result)


if __name__ == "__main__":
    main()
