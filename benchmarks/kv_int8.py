"""The int8 KV cache against float16 (the default until 2026-12-04) and float32: capacity, decode speed, perplexity, same run.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/kv_int8.py      # ~10 min; writes benchmarks/results/kv_int8.json

- Capacity: tokens each KV dtype holds in the same budget (default 1.5 GiB, the server's default), and the KV bytes
  32 conversations of 2,048 tokens need (issue 8's target: the default server under 1 GB with them).
- Decode speed: SmolLM2, native weights (the C decode step), one float16-KV and one int8-KV engine alive side by
  side with the same requests prefilled; then windows of decode steps alternate between them (float16, int8,
  float16, ...) so that load on this shared machine hits both alike; tokens/s per window, medians. At 1 stream with a
  1,024-token context and at 16 streams with 256-token contexts.
- Perplexity: the shipped held-out texts (en, zh) scored token by token through the engine (a 16-token prefill, then a
  decode step per token, as benchmarks/fidelity.py does), float32 KV as the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from tailguard.engine.engine import EngineArgs, LLMEngine
from tailguard.engine.memory import format_bytes, parse_budget
from tailguard.engine.scoring import score_text
from tailguard.engine.sequence import SamplingParams

HERE = Path(__file__).parent
TEXTS = {"en": HERE / "data" / "heldout_en.txt", "zh": HERE / "data" / "heldout_zh.txt"}
FILLER = ("The river carried the lantern past the orchard, where copper leaves fell on the meadow near the harbour. "
          "A violet summit rose behind the canvas of clouds, and the ember of evening settled over the willow. ")


def load_average() -> float:
    return os.getloadavg()[0]


def engine(kv: str, budget: str, threads: int) -> LLMEngine:
    return LLMEngine(EngineArgs(model="smollm2", kv_cache_memory=budget, kv_cache_dtype=kv, num_threads=threads,
                                max_num_seqs=32, max_num_batched_tokens=512))


def prompt_of(tokens: int, i: int, eng: LLMEngine) -> list[int]:
    ids = eng.tokenizer.encode(f"Story {i}. " + FILLER * (tokens // 30 + 2))
    return ids[:tokens]


def prefill(eng: LLMEngine, prompts: list[list[int]], tag: str) -> list[str]:
    """Add the requests and step until each has its first token: from then on every step is a pure decode step."""
    sp = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
    rids = [eng.add_request(p, sp, request_id=f"{tag}-{i}") for i, p in enumerate(prompts)]
    produced: set[str] = set()
    while len(produced) < len(rids):
        for ev in eng.step():
            produced.add(ev.request_id)
    return rids


def decode_window(eng: LLMEngine, steps: int, streams: int) -> float:
    start = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        tokens += sum(1 for _ in eng.step())
    elapsed = time.perf_counter() - start
    assert tokens == steps * streams, "every step should decode one token for every stream"
    return tokens / elapsed


def decode_speed(engines: dict[str, LLMEngine], streams: int, context: int, windows: int, steps: int) -> dict:
    runs: dict[str, list[float]] = {kv: [] for kv in engines}
    rids: dict[str, list[str]] = {}
    for kv, eng in engines.items():
        rids[kv] = prefill(eng, [prompt_of(context, i, eng) for i in range(streams)], f"s{streams}")
        decode_window(eng, 2, streams)  # warm-up
    for _ in range(windows):
        for kv, eng in engines.items():  # alternate: the same load hits both formats
            runs[kv].append(decode_window(eng, steps, streams))
    for kv, eng in engines.items():
        for rid in rids[kv]:
            eng.abort(rid)
        assert eng.pool.num_used == 0
    med = {kv: statistics.median(r) for kv, r in runs.items()}
    return {"streams": streams, "context": context, "steps_per_window": steps,
            "tokens_per_s": {kv: {"median": med[kv], "runs": runs[kv]} for kv in runs},
            "int8_vs_float16": med["int8"] / med["float16"]}


def perplexities(kv_dtypes: list[str], threads: int) -> dict:
    out: dict = {}
    for kv in kv_dtypes:
        eng = LLMEngine(EngineArgs(model="smollm2", kv_cache_tokens=4096, kv_cache_dtype=kv, num_threads=threads))
        for lang, path in TEXTS.items():
            ids = eng.tokenizer.encode(path.read_text(encoding="utf-8"))
            start = time.perf_counter()
            sc = score_text(eng, ids, 16)
            out.setdefault(kv, {})[lang] = {"perplexity": sc.perplexity, "nll": sc.nll, "top1": sc.top1,
                                            "tokens": len(ids)}
            print(f"perplexity {kv:8s} {lang}: {sc.perplexity:.4f} ({len(ids)} tokens, "
                  f"{time.perf_counter() - start:.0f} s)", flush=True)
        del eng
    base = out["float32"]
    for per_lang in out.values():
        for lang, r in per_lang.items():
            ref = base[lang]
            r["vs_float32_pct"] = 100.0 * (r["perplexity"] / ref["perplexity"] - 1.0)
            r["top1_agreement_vs_float32"] = sum(a == b for a, b in zip(r["top1"], ref["top1"])) / len(r["top1"])
            r["mean_abs_nll_diff"] = statistics.fmean(abs(a - b) for a, b in zip(r["nll"], ref["nll"]))
    for per_lang in out.values():
        for r in per_lang.values():
            del r["nll"], r["top1"]
    return out


def serve_rss(kv: str, conversations: int, context: int) -> dict:
    """benchmarks/serve_memory.py's measurement with ``--kv-cache-dtype kv``: the default `tailguard serve` (its default
    KV budget: 1.5 GiB until 2026-12-04, auto since), resident memory idle and with ``conversations`` of ``context`` tokens held at once."""
    import asyncio
    import re
    import subprocess
    import sys

    sys.path.insert(0, str(HERE))
    from serve_memory import fill, rss_mib, words_for
    from serve_vs_engine import free_port, wait_ready

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(f"/tmp/tg-kv-int8-serve-{port}.log")
    with log.open("w") as out:
        proc = subprocess.Popen([str(Path(sys.executable).with_name("tailguard")), "serve", "--port", str(port),
                                 "--no-slo", "--store", f"/tmp/tg-kv-int8-serve-{port}.db", "--kv-cache-dtype", kv,
                                 "--max-num-seqs", str(max(64, conversations))], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc)
        time.sleep(1.0)
        idle = rss_mib(proc.pid)
        max_tokens = 64
        start = time.perf_counter()
        spans = asyncio.run(fill(url, conversations, words_for(context - max_tokens - 8), max_tokens))
        wall = time.perf_counter() - start
        loaded = rss_mib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    capacity = re.search(r"KV cache ([^;]*?) = ([\d,]+) tokens", log.read_text())
    result = {"kv_cache_dtype": kv, "idle_rss_mib": idle[0], "loaded_rss_mib": loaded[0], "peak_rss_mib": loaded[1],
              "conversations": conversations, "mean_tokens_per_conversation": sum(spans) / len(spans),
              "kv_cache": capacity.group(0) if capacity else None, "wall_s": wall}
    print(f"serve, {kv} KV: RSS idle {idle[0]:.0f} MiB, {conversations} conversations of "
          f"~{result['mean_tokens_per_conversation']:.0f} tokens held {loaded[0]:.0f} MiB (peak {loaded[1]:.0f})",
          flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", default="1.5GiB")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--windows", type=int, default=7)
    parser.add_argument("--steps", type=int, default=12, help="decode steps per window")
    parser.add_argument("--ppl-kv", default="float32,float16,int8", help="KV dtypes scored (float32 is the reference)")
    parser.add_argument("--skip-ppl", action="store_true")
    parser.add_argument("--serve-rss", default="", help="also measure `tailguard serve`'s RSS with 32 x 2K-token "
                        "conversations for these KV dtypes (comma-separated, e.g. int8,float16; minutes each)")
    parser.add_argument("--only-serve-rss", action="store_true", help="measure only the server's RSS; merge it into "
                        "the existing output file")
    parser.add_argument("--output", default=str(HERE / "results" / "kv_int8.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.only_serve_rss:
        result = json.loads(Path(args.output).read_text())
        result["serve_rss"] = [serve_rss(kv, 32, 2048) for kv in args.serve_rss.split(",")]
        result["serve_rss_load_average"] = os.getloadavg()
        Path(args.output).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.output}")
        return
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or platform.machine(),
                    "threads": args.threads, "torch": torch.__version__, "load_average_start": os.getloadavg()}

    engines = {kv: engine(kv, args.budget, args.threads) for kv in ("float16", "int8")}
    budget = parse_budget(args.budget, torch.device("cpu"))
    model = engines["int8"].model
    bs = engines["int8"].args.block_size
    capacity = {}
    for kv, dtype in (("float32", torch.float32), ("float16", torch.float16), ("int8", torch.int8)):
        per_token = model.kv_bytes_per_token(dtype)
        capacity[kv] = {"bytes_per_token": per_token, "tokens": budget // (per_token * bs) * bs,
                        "kv_bytes_32x2048": 32 * 2048 * per_token}
    assert capacity["int8"]["tokens"] == engines["int8"].kv_capacity_tokens
    assert capacity["float16"]["tokens"] == engines["float16"].kv_capacity_tokens
    result["capacity"] = {"budget": args.budget, "budget_bytes": budget, "per_dtype": capacity,
                          "int8_vs_float16": capacity["int8"]["tokens"] / capacity["float16"]["tokens"],
                          "int8_vs_float32": capacity["int8"]["tokens"] / capacity["float32"]["tokens"],
                          "describe_int8": engines["int8"].describe()}
    print(engines["int8"].describe(), flush=True)

    result["decode"] = []
    for streams, context in ((1, 1024), (16, 256)):
        r = decode_speed(engines, streams, context, args.windows, args.steps)
        result["decode"].append(r)
        print(f"decode x{streams} at {context} tokens: float16 {r['tokens_per_s']['float16']['median']:.1f} tok/s, "
              f"int8 {r['tokens_per_s']['int8']['median']:.1f} tok/s ({r['int8_vs_float16']:.3f}x)", flush=True)
    del engines
    result["load_average_after_decode"] = os.getloadavg()
    if not args.skip_ppl:
        result["perplexity"] = perplexities(args.ppl_kv.split(","), args.threads)
    if args.serve_rss:
        result["serve_rss"] = [serve_rss(kv, 32, 2048) for kv in args.serve_rss.split(",")]
    result["load_average_end"] = os.getloadavg()

    print()
    print(f"| KV cache | bytes/token | tokens in {args.budget} | 32 x 2K conversations need | "
          + " | ".join(f"decode x{d['streams']} ({d['context']} ctx)" for d in result["decode"])
          + " | ppl en (vs float32) | ppl zh (vs float32) |")
    print("| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in result["decode"]) + " | ---: | ---: |")
    for kv in ("float32", "float16", "int8"):
        c = capacity[kv]
        cells = [f"{c['bytes_per_token']:,}", f"{c['tokens']:,}", format_bytes(c["kv_bytes_32x2048"])]
        for d in result["decode"]:
            t = d["tokens_per_s"].get(kv)
            cells.append(f"{t['median']:.1f} tok/s" if t else "")
        for lang in TEXTS:
            p = result.get("perplexity", {}).get(kv, {}).get(lang)
            cells.append(f"{p['perplexity']:.3f} ({p['vs_float32_pct']:+.2f}%)" if p else "")
        print(f"| {kv} | " + " | ".join(cells) + " |")
    print(f"\nload average: start {result['load_average_start'][0]:.2f}, end {result['load_average_end'][0]:.2f}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
