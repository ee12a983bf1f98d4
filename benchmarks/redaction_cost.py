"""What redaction (``--store-text``) costs per KB of text, before and after bounding it.

The store's writer thread redacts every stored prompt and output, so its cost per KB, and its worst case, delay
every request's record. Five texts, sizes in UTF-8 bytes (1 KB = 1,024 bytes), all generated from a fixed seed:

- ``mixed_pii_1k``: 1 KB of Chinese and English with personal data (phones, e-mails, cards, IDs, IPs) among
  ordinary numbers (dates, prices, order numbers, versions).
- ``mixed_clean_1k``: 1 KB of the same kind of text with no personal data (ordinary numbers only).
- ``digit_groups_100k``: 100 KB of space-separated random 4-digit groups (the hostile case: one long run of
  phone-shaped digits).
- ``english_1m``: 1 MB of ordinary English prose, with a number every twenty words or so.
- ``chinese_200k``: 200 KB of Chinese prose with dates and counts.

"before" is ``observe/redaction.py`` as of ``--before-ref`` (default: the commit before the cost bound), loaded
from ``git show`` into a temporary module; "after" is the working tree's. Both run in the same process, one after
the other, on ``Redactor.redact`` (find and replace), each text ``--repeats`` times: medians of the wall-clock
time and of the calling thread's CPU time (steadier on a shared machine). Small texts are timed in batches so that
a sample lasts >= 20 ms; the slow "before" cases run ``--slow-repeats`` times. The after redactor's cache of
metadata-check answers is cleared before every call, so a repeated text is measured as new.

    python benchmarks/redaction_cost.py             # ~3 minutes (the "before" hostile case is ~20 s a run)
    python benchmarks/redaction_cost.py --quick     # a smoke run: after only, results to a temporary file
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import random
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent
MODULE = "src/tailguard/observe/redaction.py"
BEFORE_REF = "0fd6da7"  # the rewrite with our own finders, phones and IPs still found by Presidio on the whole text

_EN_WORDS = ("the system reads each request and writes a short record for later review when the queue is "
             "long we keep only what the operator asked for and drop the rest after seven days most of the "
             "time nothing unusual happens but on busy evenings the gateway may shed traffic to protect "
             "latency for interactive users while batch jobs wait their turn").split()
_ZH_SENTENCES = ("系统会记录每个请求的处理时间。", "如果队列太长，网关会优先处理交互式请求。", "批处理任务会在夜间运行。",
                 "运维人员可以查看过去七天的记录。", "大多数时候一切正常。", "模型的回答需要经过审核后才能保存。",
                 "我们正在评估新的调度策略。", "请在提交前检查配置文件。")


def _num(rng: random.Random) -> str:
    """An ordinary number, as prose and logs have them: never personal data."""
    return rng.choice([
        str(rng.randint(1, 99)), str(rng.randint(100, 9999)), str(rng.randint(1990, 2030)),
        f"{rng.randint(1, 999)}.{rng.randint(0, 99):02d}", f"{rng.randint(2019, 2025)}-{rng.randint(1, 12):02d}-"
        f"{rng.randint(1, 28):02d}", f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}",
        f"v{rng.randint(0, 9)}.{rng.randint(0, 20)}.{rng.randint(0, 99)}", f"{rng.randint(1, 99)}%",
    ])


def _clean_snippets(rng: random.Random) -> list[str]:
    return [
        f"订单号 {rng.randint(10**9, 10**10)} 已发货，预计 {rng.randint(1, 5)} 天到达。",
        f"The build {_num(rng)} finished at {_num(rng)} with {rng.randint(2, 900)} tests passing.",
        f"价格 ¥{rng.randint(10, 9999)}.{rng.randint(0, 99):02d}，库存 {rng.randint(1, 500)} 件。",
        f"{rng.randint(2019, 2025)}年{rng.randint(1, 12)}月{rng.randint(1, 28)}日召开会议，共 {rng.randint(5, 300)} 人参加。",
        f"Release {_num(rng)} fixes {rng.randint(1, 40)} bugs; see ticket #{rng.randint(1000, 99999)}.",
        f"日志 {rng.randint(2019, 2025)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} "
        f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d} 启动完成。",
    ]


def _pii_snippets(rng: random.Random) -> list[str]:
    """Personal data, digits drawn afresh each time (a text that repeats one number would flatter a cache)."""
    card = rng.choice(["6212 3456 7890 1234 569", "4111-1111-1111-1111", "5500 0000 0000 0004", "6225880123456789017",
                       "378282246310005"])
    resident_id = rng.choice(["11010519491231002X", "110101 19900307 109X", "440301198512125677"])
    return [
        f"我的手机号是13{rng.randint(0, 9)}{rng.randint(10**7, 10**8 - 1)}，请回电。",
        f"Call me at +1 (415) 555-{rng.randint(1000, 1999)} after five.",
        f"邮箱 user{rng.randint(1, 999)}@example.com，抄送 张{rng.randint(1, 99)}@例子.中国。",
        f"卡号 {card} 已绑定。",
        f"Card {card} expires {rng.randint(1, 12):02d}/{rng.randint(25, 30)}.",
        f"身份证 {resident_id}，旧证 110101900307123。",
        f"server 192.168.{rng.randint(0, 255)}.{rng.randint(1, 254)} and 2001:db8::{rng.randint(1, 99)} are up.",
        f"电话 010-{rng.randint(6000_0000, 6999_9999)}，传真 +86 21 {rng.randint(5000, 6999)} {rng.randint(1000, 9999)}。",
    ]


def _fill(rng: random.Random, size: int, parts) -> str:
    out: list[str] = []
    used = 0
    while used < size:
        s = parts(rng)
        out.append(s)
        used += len(s.encode()) + 1
    return _cut(" ".join(out), size)


def _cut(text: str, size: int) -> str:
    """``text`` cut to at most ``size`` UTF-8 bytes (whole characters)."""
    return text.encode()[:size].decode(errors="ignore")


def texts(seed: int = 7) -> dict[str, str]:
    rng = random.Random(seed)
    pii = _fill(rng, 1024, lambda r: r.choice(_pii_snippets(r) + _clean_snippets(r)[:3]))
    clean = _fill(rng, 1024, lambda r: r.choice(_clean_snippets(r)))
    groups = _cut(" ".join(f"{rng.randint(0, 9999):04d}" for _ in range(100 * 1024 // 5 + 1)), 100 * 1024)

    def english(r: random.Random) -> str:
        words = [r.choice(_EN_WORDS) if r.random() > 0.05 else _num(r) for _ in range(r.randint(8, 20))]
        return " ".join(words).capitalize() + "."

    def chinese(r: random.Random) -> str:
        s = r.choice(_ZH_SENTENCES)
        if r.random() < 0.2:
            s += f"截至{r.randint(2019, 2025)}年{r.randint(1, 12)}月，已处理{r.randint(1, 99999)}条。"
        return s

    return {"mixed_pii_1k": pii, "mixed_clean_1k": clean, "digit_groups_100k": groups,
            "english_1m": _fill(rng, 1024 * 1024, english), "chinese_200k": _fill(rng, 200 * 1024, chinese)}


def load_before(ref: str) -> ModuleType:
    """``observe/redaction.py`` as of ``ref``, imported from a temporary file as its own module."""
    source = subprocess.run(["git", "show", f"{ref}:{MODULE}"], cwd=ROOT.parent, check=True, capture_output=True,
                            text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="redaction_before_")) / "redaction_before.py"
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("redaction_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_redact(redact, text: str, repeats: int, slow_repeats: int, reset=None) -> dict:
    """Per ``redact(text)``: wall-clock and CPU (this thread's) seconds, medians over ``repeats`` samples
    (``slow_repeats`` when one call takes over 2 s, the first call then being one of them). A sample of a fast
    call times a batch of calls lasting >= 20 ms; ``reset`` runs before each call."""
    reset = reset or (lambda: None)
    reset()
    w0, c0 = time.perf_counter(), time.thread_time()
    out = redact(text)  # warms the caches that live as long as the redactor (metadata, suffix list) too
    first = (time.perf_counter() - w0, time.thread_time() - c0)
    slow = first[0] > 2
    batch = max(1, int(0.02 / max(first[0], 1e-6)))
    walls, cpus = ([first[0]], [first[1]]) if slow else ([], [])
    while len(walls) < (slow_repeats if slow else repeats):
        wall = cpu = 0.0
        for _ in range(batch):
            reset()
            w0, c0 = time.perf_counter(), time.thread_time()
            redact(text)
            wall += time.perf_counter() - w0
            cpu += time.thread_time() - c0
        walls.append(wall / batch)
        cpus.append(cpu / batch)
    kinds: dict[str, int] = {}
    for kind in _PLACEHOLDER.findall(out):
        kinds[kind] = kinds.get(kind, 0) + 1
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus), "wall_samples_s": walls,
            "cpu_samples_s": cpus, "calls_per_sample": batch, "placeholders": kinds,
            "output_sha256_16": hashlib.sha256(out.encode()).hexdigest()[:16]}


_PLACEHOLDER = re.compile(r"<([A-Z_]+)>")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before-ref", default=BEFORE_REF, help="git revision of the 'before' redaction.py")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--slow-repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="after only, one sample each, results to a temp file")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "redaction_cost.json")
    args = ap.parse_args()
    if args.quick:
        args.repeats = args.slow_repeats = 1
        args.out = Path(tempfile.mkdtemp(prefix="redaction_cost_")) / "redaction_cost.json"

    from tailguard.observe.redaction import Redactor

    after = Redactor()
    # The after redactor keeps the metadata check's answer per digit run; each call starts without them, so
    # that repeating a text measures it as new (numbers repeated within a text still hit).
    versions = {"after": (after.redact, after._phones._regions.cache_clear)}
    if not args.quick:
        versions = {"before": (load_before(args.before_ref).Redactor().redact, None), **versions}
    cases = texts()
    for redact, _ in versions.values():  # metadata loaded and patterns compiled on first use: not timed
        for text in cases.values():
            redact(text[:2000])
    rows: dict[str, dict] = {}
    for name, text in cases.items():
        kb = len(text.encode()) / 1024
        rows[name] = {"bytes": len(text.encode()), "chars": len(text)}
        for version, (redact, reset) in versions.items():
            r = time_redact(redact, text, args.repeats, args.slow_repeats, reset)
            r["wall_ms_per_kb"] = r["wall_s"] * 1000 / kb
            r["cpu_ms_per_kb"] = r["cpu_s"] * 1000 / kb
            rows[name][version] = r
        if "before" in rows[name]:
            rows[name]["same_output"] = rows[name]["before"]["output_sha256_16"] == r["output_sha256_16"]
            print(f"{name:>18} {version:>6}: {r['wall_ms_per_kb']:9.3f} ms/KB wall {r['cpu_ms_per_kb']:9.3f} cpu  "
                  f"{r['wall_s'] * 1000:10.2f} ms  {r['placeholders']}", flush=True)

    nan = float("nan")
    print("\nms per KB (1 KB = 1,024 UTF-8 bytes), medians; CPU = the redacting thread's CPU time")
    print(f"{'text':>18} {'KB':>6} | {'before':>9} {'after':>8} {'x':>6} | {'before cpu':>10} {'after cpu':>9} | "
          f"{'after ms':>9} | same output")
    for name, row in rows.items():
        b, a = row.get("before", {}), row["after"]
        bw, bc = b.get("wall_ms_per_kb", nan), b.get("cpu_ms_per_kb", nan)
        print(f"{name:>18} {row['bytes'] / 1024:6.0f} | {bw:9.3f} {a['wall_ms_per_kb']:8.3f} "
              f"{bw / a['wall_ms_per_kb']:6.1f} | {bc:10.3f} {a['cpu_ms_per_kb']:9.3f} | {a['wall_s'] * 1000:9.2f} | "
              f"{row.get('same_output', '-')}")
    result = {
        "platform": {"python": platform.python_version(), "machine": platform.machine(),
                     "processor": platform.processor(), "cpus": os.cpu_count(),
                     "load_avg_at_end": os.getloadavg()},
        "config": {"before_ref": None if args.quick else args.before_ref, "repeats": args.repeats,
                   "slow_repeats": args.slow_repeats, "budget_ms": after.budget_ms,
                   "budget_ms_per_kchar": after.budget_ms_per_kchar, "kb_bytes": 1024, "seed": 7},
        "texts": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
