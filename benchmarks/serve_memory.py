"""Resident memory of the default `tailguard serve` on SmolLM2: at start-up, and after conversations fill its KV cache.

    .venv/bin/python benchmarks/serve_memory.py                  # 5-12 min; benchmarks/results/serve_memory.json
    .venv/bin/python benchmarks/serve_memory.py --conversations 32 --context 2048
    .venv/bin/python benchmarks/serve_memory.py --server-args "--kv-cache-dtype int8 --kv-cache-memory 768MiB"   # any serve flags

The server runs with its defaults (native weights on the native runner, which never imports torch; int8 KV in a 768 MiB
budget: 33 conversations of 2K; `--server-args "--runner torch"` for the same with torch's runner). The KV cache is reserved as address
space and becomes resident as blocks are first used, so the figure that matters is the resident set (VmRSS) and its
peak (VmHWM) with N conversations of C tokens held at once: each request's prompt plus max_tokens spans C tokens, and
they all run concurrently. Every prompt opens with its own number, so no two conversations share KV blocks through
the prefix cache beyond the chat template's first block (otherwise conversation i and i + 16 were the same text and
the figure depended on whether the second arrived after the first was cached). Reported beside it: the KV capacity the
server logged, and the resident set split into anonymous memory (the heap, torch's tensors), shared memory (the KV
cache, an anonymous shared mapping) and file-backed pages (the shared libraries' code and data).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).parent))
from serve_vs_engine import free_port, wait_ready  # noqa: E402

WORDS = ("river lantern orchard copper meadow harbour violet summit canvas ember quartz willow thunder saffron "
         "marble falcon").split()


def rss_mib(pid: int) -> tuple[float, float]:
    status = memory_status(pid)
    return status["VmRSS"], status["VmHWM"]


def memory_status(pid: int) -> dict[str, float]:
    """MiB from /proc/PID/status: VmRSS (= RssAnon + RssFile + RssShmem) and its peak VmHWM."""
    status = Path(f"/proc/{pid}/status").read_text()
    return {key: int(re.search(rf"{key}:\s+(\d+)", status).group(1)) / 1024
            for key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")}


def prompt_text(i: int, words: int) -> str:
    # The number first: the words cycle with a period of 16, so without it prompts i and i + 16 were identical.
    return f"{i}. " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(words))


def words_for(tokens: int) -> int:
    """How many words make a chat prompt of about ``tokens`` tokens (measured with the model's tokenizer)."""
    from tailguard.engine.model_store import resolve_model_path
    from tailguard.engine.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer(resolve_model_path("smollm2"))
    per_word = len(tok.encode_chat([{"role": "user", "content": prompt_text(0, 1000)}])) / 1000
    return int(tokens / per_word)


async def conversation(session: aiohttp.ClientSession, url: str, i: int, prompt_words: int, max_tokens: int) -> int:
    text = prompt_text(i, prompt_words)
    body = {"model": "smollm2", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {data}")
        return data["usage"]["prompt_tokens"] + data["usage"]["completion_tokens"]


async def fill(url: str, n: int, prompt_words: int, max_tokens: int) -> list[int]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        return await asyncio.gather(*(conversation(session, url, i, prompt_words, max_tokens) for i in range(n)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--context", type=int, default=2048, help="tokens each conversation spans")
    parser.add_argument("--server-args", default="", help="extra `tailguard serve` flags, e.g. '--kv-cache-dtype int8'")
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "serve_memory.json"))
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(f"/tmp/tg-serve-memory-{port}.log")
    with log.open("w") as out:
        proc = subprocess.Popen([str(Path(sys.executable).with_name("tailguard")), "serve", "--port", str(port),
                                 "--no-slo", "--store", f"/tmp/tg-serve-memory-{port}.db",
                                 "--max-num-seqs", str(max(64, args.conversations)), *shlex.split(args.server_args)],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc)
        time.sleep(1.0)
        idle = memory_status(proc.pid)
        print(f"idle: RSS {idle['VmRSS']:.0f} MiB (anonymous {idle['RssAnon']:.0f}, files {idle['RssFile']:.0f})",
              flush=True)
        # the prompt takes the context less 64 tokens, then 64 are generated
        max_tokens = 64
        start = time.perf_counter()
        spans = asyncio.run(fill(url, args.conversations, words_for(args.context - max_tokens - 8), max_tokens))
        wall = time.perf_counter() - start
        loaded = memory_status(proc.pid)
        print(f"after {args.conversations} conversations of ~{sum(spans) / len(spans):.0f} tokens ({wall:.0f} s): "
              f"RSS {loaded['VmRSS']:.0f} MiB (anonymous {loaded['RssAnon']:.0f}, KV {loaded['RssShmem']:.0f}, "
              f"files {loaded['RssFile']:.0f}), "
              f"peak {loaded['VmHWM']:.0f} MiB", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    capacity = re.search(r"KV cache (.*?) = ([\d,]+) tokens", log.read_text())
    result = {"idle_rss_mib": idle["VmRSS"], "loaded_rss_mib": loaded["VmRSS"], "peak_rss_mib": loaded["VmHWM"],
              "idle": idle, "loaded": loaded, "server_args": args.server_args,
              "conversations": args.conversations, "tokens_per_conversation": spans,
              "kv_cache": capacity.group(0) if capacity else None, "wall_s": wall,
              "date": time.strftime("%Y-%m-%d %H:%M")}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "tokens_per_conversation"}, indent=2))


if __name__ == "__main__":
    main()
