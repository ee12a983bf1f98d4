"""Workloads: what each request asks for.

* synthetic prompts of a target token length in English, Chinese or a mix, and long-context ones (a document and a
  question about it);
* JSONL files, one request per line: ``prompt`` or ``messages``, optional ``max_tokens``, ``business_type``, ``user``;
* the Azure LLM inference traces of 2023 (shipped in ``tailguard/bench/data``, CC-BY 4.0) or any CSV of the same
  shape, with their arrival times and input/output lengths, scaled in time and length.

Synthetic prompts are cut from a seeded corpus at sentence starts, a different place for each request, so that no
two requests share a prefix (a server's prefix cache cannot flatter the numbers) and building them costs one decode.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tailguard.bench.tokens import language_of

DATA_DIR = Path(__file__).parent / "data"
BUILTIN_TRACES = {
    "conv": DATA_DIR / "AzureLLMInferenceTrace_conv.csv",
    "code": DATA_DIR / "AzureLLMInferenceTrace_code.csv",
    # the names people know them by (the dataset's own): the same files
    "azure-conv": DATA_DIR / "AzureLLMInferenceTrace_conv.csv",
    "azure-code": DATA_DIR / "AzureLLMInferenceTrace_code.csv",
}
LANGS = ("en", "zh", "mixed")


@dataclass(slots=True)
class RequestSpec:
    """One request of a workload."""

    prompt: str | None = None
    messages: list[dict] | None = None
    max_tokens: int = 128
    business_type: str | None = None
    user: str | None = None
    lang: str = "en"
    input_tokens: int | None = None  # the target (synthetic) or the trace's count; None: unknown
    local_prompt_tokens: int | None = None  # what the bench's tokenizer counts
    trace_time: float | None = None  # seconds from the trace's start (trace replay)
    extra: dict[str, Any] | None = None
    traffic_class: str | None = None  # the request's traffic class (bench/classes.py), None without classes

    def text(self) -> str:
        if self.prompt is not None:
            return self.prompt
        return "\n".join(str(m.get("content", "")) for m in self.messages or ())


# --- synthetic text ---------------------------------------------------------------------------------------------

_EN_WORDS = (
    "the system request latency model server token batch queue memory cache user answer question service time "
    "first second network response stream prefill decode compute budget tail percentile median capacity load "
    "throughput error rate client engine schedule priority window sample report change test deploy release team "
    "data center region traffic peak hour night morning customer support order payment account price market "
    "report doctor patient record result analysis summary document page chapter section table figure value "
    "number growth risk policy rule plan week month year city river mountain road car train flight hotel food "
    "coffee water light energy power signal message email phone screen keyboard window door room house garden "
    "small large fast slow early late simple clear strong quiet bright careful useful important different common"
).split()
_EN_VERBS = (
    "measures reports explains sends receives reduces improves checks keeps finds shows needs uses builds runs "
    "moves changes starts stops waits returns handles follows compares describes updates tracks limits"
).split()
_EN_GLUE = "and but because while when so although after before since".split()

_ZH_WORDS = (
    "系统 请求 延迟 模型 服务器 令牌 批处理 队列 内存 缓存 用户 回答 问题 服务 时间 网络 响应 流式 预填充 解码 "
    "计算 预算 尾部 百分位 中位数 容量 负载 吞吐量 错误率 客户端 引擎 调度 优先级 窗口 样本 报告 变更 测试 部署 "
    "发布 团队 数据 中心 地区 流量 高峰 夜间 早晨 客户 支持 订单 支付 账户 价格 市场 医生 患者 病历 结果 分析 "
    "摘要 文档 页面 章节 表格 数值 增长 风险 政策 规则 计划 城市 河流 山脉 道路 汽车 火车 航班 酒店 食物 咖啡 "
    "能源 信号 消息 邮件 手机 屏幕 键盘 房间 花园 金融 行情 诊断 影像 检查 血压 心率 症状 治疗 药物 剂量"
).split()
_ZH_VERBS = "测量 报告 解释 发送 接收 降低 提高 检查 保持 发现 显示 需要 使用 构建 运行 改变 开始 等待 返回 处理 比较 描述 更新 跟踪 限制".split()
_ZH_GLUE = "而且 但是 因为 同时 所以 虽然 之后 之前 如果 然后".split()
_ZH_PARTICLES = "的 了 在 和 把 对 从 向 被 让".split()


def _en_sentence(rng: random.Random) -> str:
    words = [rng.choice(_EN_WORDS) for _ in range(rng.randint(3, 6))]
    words.insert(rng.randint(1, len(words) - 1), rng.choice(_EN_VERBS))
    if rng.random() < 0.4:
        words += [rng.choice(_EN_GLUE), "the", rng.choice(_EN_WORDS), rng.choice(_EN_VERBS)]
        words += [rng.choice(_EN_WORDS) for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.15:
        words.append(str(rng.randint(2, 9999)))
    s = " ".join(words)
    return " " + s[0].upper() + s[1:] + rng.choice(".....?!")


def _zh_sentence(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(2, 4)):
        parts.append(rng.choice(_ZH_WORDS) + rng.choice(_ZH_PARTICLES) + rng.choice(_ZH_WORDS))
        parts.append(rng.choice(_ZH_VERBS) + rng.choice(_ZH_WORDS))
        if rng.random() < 0.3:
            parts.append("，" + rng.choice(_ZH_GLUE))
    if rng.random() < 0.15:
        parts.append(str(rng.randint(2, 9999)))
    return "".join(parts) + rng.choice("。。。。？！")


def _sentence(lang: str, rng: random.Random) -> str:
    if lang == "zh":
        return _zh_sentence(rng)
    if lang == "mixed":
        return _zh_sentence(rng) if rng.random() < 0.5 else _en_sentence(rng)
    return _en_sentence(rng)


class Corpus:
    """A seeded token stream of one language, with the token offsets where sentences start."""

    def __init__(self, tokenizer, lang: str, min_tokens: int, seed: int) -> None:
        rng = random.Random(f"corpus:{lang}:{seed}")
        self.ids: list[int] = []
        self.starts: list[int] = []
        batch = 256
        while len(self.ids) < min_tokens:
            sentences = [_sentence(lang, rng) for _ in range(batch)]
            for ids in tokenizer.encode_batch(sentences):
                self.starts.append(len(self.ids))
                self.ids.extend(ids)
        self.tokenizer = tokenizer

    def take(self, n: int, rng: random.Random) -> tuple[str, int]:
        """About ``n`` tokens of text from a random sentence start; returns (text, token count)."""
        ids = self.ids
        usable = [s for s in self.starts[: max(1, len(self.starts) // 2)]] if n > len(ids) // 2 else self.starts
        start = rng.choice(usable)
        out = ids[start : start + n]
        while len(out) < n:  # longer than the corpus: wrap around
            out = out + ids[: n - len(out)]
        text = self.tokenizer.decode(out)
        trim = 0
        while text.endswith("\ufffd") and trim < 4:  # a cut inside a multi-byte character
            trim += 1
            text = self.tokenizer.decode(out[: len(out) - trim])
        return text.strip(), len(out) - trim


_LONG_QUESTIONS = {
    "en": "\n\nQuestion: summarize the document above in three sentences, citing the sections you used.",
    "zh": "\n\n问题：请用三句话总结上面的文档，并注明引用的章节。",
    "mixed": "\n\nQuestion: 请总结上面的 document，in three sentences.",
}


@dataclass
class SyntheticWorkload:
    """Prompts of a target token length (uniform +- ``input_spread``) in one language or a mix of several."""

    tokenizer: Any
    input_tokens: int = 256
    output_tokens: int = 128
    langs: tuple[str, ...] = ("en",)
    input_spread: float = 0.0
    output_spread: float = 0.0
    long_context: bool = False
    seed: int = 0
    business_type: str | None = None
    _corpora: dict[str, Corpus] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for lang in self.langs:
            if lang not in LANGS:
                raise ValueError(f"unknown language {lang!r}; choose from {', '.join(LANGS)}")
        need = int(self.input_tokens * (1 + self.input_spread)) + 64
        for lang in self.langs:
            self._corpora[lang] = Corpus(self.tokenizer, lang, max(4 * need, 8192), self.seed)

    @property
    def name(self) -> str:
        return ("long-context" if self.long_context else "synthetic") + ":" + "+".join(self.langs)

    def describe(self) -> dict:
        return {"kind": "long-context" if self.long_context else "synthetic", "langs": list(self.langs),
                "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "input_spread": self.input_spread, "output_spread": self.output_spread,
                "tokenizer": getattr(self.tokenizer, "name", "?")}

    def spec(self, i: int) -> RequestSpec:
        rng = random.Random(f"req:{self.seed}:{i}")
        lang = self.langs[i % len(self.langs)]
        n_in = _spread(self.input_tokens, self.input_spread, rng)
        n_out = _spread(self.output_tokens, self.output_spread, rng)
        if self.long_context:
            q = _LONG_QUESTIONS[lang]
            qn = len(self.tokenizer.encode(q))
            body, got = self._corpora[lang].take(max(1, n_in - qn), rng)
            text, count = body + q, got + qn
        else:
            text, count = self._corpora[lang].take(n_in, rng)
        return RequestSpec(prompt=text, max_tokens=n_out, lang=lang, input_tokens=n_in, local_prompt_tokens=count,
                           business_type=self.business_type)


def _spread(n: int, spread: float, rng: random.Random) -> int:
    if not spread:
        return max(1, n)
    return max(1, round(n * (1 + rng.uniform(-spread, spread))))


# --- JSONL ------------------------------------------------------------------------------------------------------

@dataclass
class JsonlWorkload:
    """One request per line; requests are taken in file order (shuffled with the seed when ``shuffle``), cycling."""

    path: Path
    default_max_tokens: int = 128
    shuffle: bool = False
    seed: int = 0
    items: list[RequestSpec] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        with self.path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line or line.startswith("//"):
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as exc:
                    raise ValueError(f"{self.path}:{lineno}: not JSON: {exc}") from None
                if not isinstance(obj, dict):
                    raise ValueError(f"{self.path}:{lineno}: a request is a JSON object, not {type(obj).__name__}")
                self.items.append(self._spec(obj, lineno))
        if not self.items:
            raise ValueError(f"{self.path}: no requests")
        if self.shuffle:
            random.Random(f"jsonl:{self.seed}").shuffle(self.items)

    def _spec(self, obj: dict, lineno: int) -> RequestSpec:
        prompt, messages = obj.get("prompt"), obj.get("messages")
        if prompt is None and messages is None:
            raise ValueError(f"{self.path}:{lineno}: needs 'prompt' or 'messages'")
        if messages is not None and (not isinstance(messages, list) or
                                     not all(isinstance(m, dict) and "content" in m for m in messages)):
            raise ValueError(f"{self.path}:{lineno}: 'messages' must be a list of {{role, content}} objects")
        max_tokens = obj.get("max_tokens") or obj.get("output_tokens") or self.default_max_tokens
        if isinstance(max_tokens, float) and max_tokens.is_integer():  # 64.0, as a data frame writes it
            max_tokens = int(max_tokens)
        if type(max_tokens) is not int or max_tokens < 1:
            raise ValueError(f"{self.path}:{lineno}: 'max_tokens' must be a positive integer, not {max_tokens!r:.40}")
        spec = RequestSpec(prompt=None if prompt is None else str(prompt), messages=messages,
                           max_tokens=int(max_tokens), business_type=obj.get("business_type"), user=obj.get("user"))
        spec.lang = obj.get("lang") or language_of(spec.text())
        return spec

    @property
    def name(self) -> str:
        return f"jsonl:{self.path.name}"

    def describe(self) -> dict:
        return {"kind": "jsonl", "path": str(self.path), "requests_in_file": len(self.items), "shuffle": self.shuffle}

    def spec(self, i: int) -> RequestSpec:
        s = self.items[i % len(self.items)]
        return RequestSpec(prompt=s.prompt, messages=s.messages, max_tokens=s.max_tokens,
                           business_type=s.business_type, user=s.user, lang=s.lang)


# --- traces -----------------------------------------------------------------------------------------------------

@dataclass(slots=True)
class TraceRow:
    t: float  # seconds since the trace's first request
    input_tokens: int
    output_tokens: int
    cls: str | None = None  # the traffic class named by the trace's class column, when one is read


def _parse_ts(s: str) -> float:
    """``2023-11-16 18:17:03.9799600`` -> seconds since midnight of that day plus days (enough for offsets)."""
    date, _, clock = s.strip().partition(" ")
    y, mo, d = (int(x) for x in date.split("-"))
    h, mi, sec = clock.split(":")
    # days since an epoch via the proleptic Gregorian ordinal, so traces that pass midnight stay monotone
    import datetime as _dt

    day = _dt.date(y, mo, d).toordinal()
    return day * 86400.0 + int(h) * 3600.0 + int(mi) * 60.0 + float(sec)


def trace_path(source: str | Path) -> Path:
    return Path(BUILTIN_TRACES.get(str(source), Path(source)))


def trace_columns(source: str | Path) -> list[str]:
    """The header of a trace's CSV (to find a class column before the run)."""
    with trace_path(source).open(newline="", encoding="utf-8") as f:
        return next(csv.reader(f), [])


def load_trace(source: str | Path, class_column: str | None = None) -> list[TraceRow]:
    """A trace by built-in name (``conv``, ``code``) or CSV path: TIMESTAMP, ContextTokens, GeneratedTokens.

    The timestamp may be a date-time or a number of seconds. Rows are sorted by time; offsets start at 0.
    ``class_column`` (matched without regard to case) names each row's traffic class.
    """
    path = trace_path(source)
    if not Path(path).is_file():
        raise FileNotFoundError(f"trace not found: {source} (built in: {', '.join(BUILTIN_TRACES)})")
    rows: list[tuple[float, int, int, str | None]] = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        cols = {c.lower(): c for c in reader.fieldnames or ()}
        tcol = cols.get("timestamp") or cols.get("time") or cols.get("arrival_time")
        icol = cols.get("contexttokens") or cols.get("input_tokens") or cols.get("prompt_tokens")
        ocol = cols.get("generatedtokens") or cols.get("output_tokens") or cols.get("completion_tokens")
        if not (tcol and icol and ocol):
            raise ValueError(f"{path}: needs TIMESTAMP, ContextTokens and GeneratedTokens columns")
        ccol = cols.get(class_column.lower()) if class_column else None
        if class_column and not ccol:
            raise ValueError(f"{path}: no column {class_column!r} to take the traffic class from (columns: "
                             f"{', '.join(reader.fieldnames or ())})")
        for lineno, r in enumerate(reader, 2):
            raw = r[tcol]
            try:
                t = float(raw)
            except ValueError:
                t = _parse_ts(raw)
            cls = None
            if ccol:
                cls = (r.get(ccol) or "").strip()
                if not cls:
                    raise ValueError(f"{path}:{lineno}: the {ccol} column is empty: every row needs its class")
            rows.append((t, int(float(r[icol])), int(float(r[ocol])), cls))
    rows.sort(key=lambda x: x[0])
    t0 = rows[0][0] if rows else 0.0
    return [TraceRow(t - t0, i, o, c) for t, i, o, c in rows]


def busiest_window(source: str | Path, seconds: float) -> tuple[float, int]:
    """(start, arrivals) of the ``seconds``-long stretch of the trace with the most arrivals: its peak.

    Trace seconds (before any time scaling). A trace shorter than ``seconds`` gives its whole length from 0."""
    if not seconds > 0:
        raise ValueError("a window needs a positive length in seconds")
    times = [r.t for r in load_trace(source)]
    best_start, best_n, j = 0.0, 0, 0
    # two pointers over the sorted arrivals: the window starting at arrival i holds arrivals i..j-1
    for i, t in enumerate(times):
        while j < len(times) and times[j] < t + seconds:
            j += 1
        if j - i > best_n:
            best_start, best_n = t, j - i
    return best_start, best_n


def parse_window(text: str) -> tuple[str, float | None, float | None]:
    """``busiest:600`` -> ("busiest", None, 600.0); ``120:600`` -> ("range", 120.0, 600.0); ``all`` -> ("all", None,
    None). A ValueError names the forms accepted."""
    t = text.strip().lower()
    if t == "all":
        return "all", None, None
    head, sep, tail = t.partition(":")
    try:
        length = float(tail) if sep else float("nan")
        start = None if head == "busiest" else float(head)
    except ValueError:
        length = float("nan")
        start = None
    if not sep or not length > 0 or length == float("inf") or (start is not None and not start >= 0):
        raise ValueError(f"--window takes busiest:SECONDS (the trace's peak), START:SECONDS or all; got {text!r}")
    return ("busiest" if start is None else "range"), start, length


@dataclass
class TraceWorkload:
    """Replays a trace: its arrival offsets (divided by ``speedup``) and its lengths (times ``length_scale``).

    ``start`` and ``duration`` (trace seconds) pick a window of the trace; ``max_input_tokens`` and
    ``max_output_tokens`` clip lengths to what the server can take. Prompts are synthetic text of the trace's length
    (the trace withholds the text).
    """

    tokenizer: Any
    source: str = "conv"
    speedup: float = 1.0
    length_scale: float = 1.0
    start: float = 0.0
    duration: float | None = None
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    lang: str = "en"
    seed: int = 0
    class_column: str | None = None  # a column naming each row's traffic class
    rows: list[TraceRow] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.speedup <= 0 or self.length_scale <= 0:
            raise ValueError("speedup and length scale must be positive")
        rows = load_trace(self.source, self.class_column)
        end = self.start + self.duration if self.duration is not None else float("inf")
        rows = [r for r in rows if self.start <= r.t < end]
        if not rows:
            raise ValueError("the trace window holds no requests")
        t0 = rows[0].t
        self.rows = [TraceRow(r.t - t0, r.input_tokens, r.output_tokens, r.cls) for r in rows]
        longest = max(self._in(r) for r in self.rows)
        self._corpus = Corpus(self.tokenizer, self.lang, max(2 * longest, 8192), self.seed)

    def _in(self, r: TraceRow) -> int:
        n = max(1, round(r.input_tokens * self.length_scale))
        return min(n, self.max_input_tokens) if self.max_input_tokens else n

    def _out(self, r: TraceRow) -> int:
        n = max(1, round(r.output_tokens * self.length_scale))
        return min(n, self.max_output_tokens) if self.max_output_tokens else n

    @property
    def name(self) -> str:
        return f"trace:{Path(str(self.source)).stem}"

    def __len__(self) -> int:
        return len(self.rows)

    def class_of(self, i: int) -> str | None:
        """The traffic class the trace names for request ``i`` (None without a class column)."""
        return self.rows[i % len(self.rows)].cls

    def offsets(self) -> list[float]:
        """Intended send offsets (seconds from the start of the replay): trace offsets / speedup."""
        return [r.t / self.speedup for r in self.rows]

    def trace_rate(self) -> float:
        span = self.rows[-1].t - self.rows[0].t
        return (len(self.rows) - 1) / span if span > 0 else float("inf")

    def describe(self) -> dict:
        d = self._describe()
        if self.class_column:
            d["class_column"] = self.class_column
        return d

    def _describe(self) -> dict:
        return {"kind": "trace", "source": str(self.source), "requests": len(self.rows), "speedup": self.speedup,
                "length_scale": self.length_scale, "window_start_s": self.start, "window_duration_s": self.duration,
                "trace_rate_rps": self.trace_rate(), "replay_rate_rps": self.trace_rate() * self.speedup,
                "max_input_tokens": self.max_input_tokens, "max_output_tokens": self.max_output_tokens,
                "lang": self.lang, "note": "prompt text is synthetic: the trace withholds it"}

    def spec(self, i: int) -> RequestSpec:
        r = self.rows[i % len(self.rows)]
        rng = random.Random(f"trace:{self.seed}:{i}")
        n_in = self._in(r)
        text, count = self._corpus.take(n_in, rng)
        return RequestSpec(prompt=text, max_tokens=self._out(r), lang=self.lang, input_tokens=n_in,
                           local_prompt_tokens=count, trace_time=r.t, traffic_class=r.cls)
