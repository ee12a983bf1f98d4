"""The demo's report: each request's timeline as the server recorded it, the machine it ran on, and what it shows.

Everything drawn comes from the server's records (``GET /v1/requests/{id}``): the boundaries (received, tokenized,
scheduled, first token, last token, last byte), the time each token was produced (``token_times``) and the time each
left the server (``token_sent``). The engine stamps every token of one step with the same instant, so the distinct
token times of all requests are the ends of the engine's steps: they split a request's prefill into the steps its
prompt was computed in, and tell a decode gap (a step that also computed other requests' prompts) from a steady
step. Nothing here is estimated from the client's side.
"""

from __future__ import annotations

import contextlib
import html
import os
import platform
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# Stages as the report draws them, in time order. "waiting" (tokens made but not yet sent) overlaps decode, so it
# is drawn on a thin lane of its own and left out of the additive split.
SEGMENT_STAGES = ("tokenize", "queue", "prefill", "decode", "decode gap", "stream")
STAGE_COLORS = {"tokenize": "#9467bd", "queue": "#d62728", "prefill": "#ff7f0e", "decode": "#1f77b4",
                "decode gap": "#c6dbef", "stream": "#2ca02c", "waiting": "#8c564b"}
STAGE_HELP = {
    "tokenize": "the server turned the chat into prompt tokens",
    "queue": "waiting for the engine to take the request into a step",
    "prefill": "the engine computed the prompt, one segment per engine step (a chunk)",
    "decode": "one output token per engine step",
    "decode gap": "no token for this request for several step times: the step also computed other requests' prompts",
    "stream": "after the last token: the response's final bytes",
    "waiting": "tokens already made but not yet sent: an incomplete character (Chinese takes several tokens per "
               "character) or a tail that might still become a stop string",
}
# A token interval longer than this many times the burst's median is drawn as a gap.
GAP_FACTOR = 3.0
STEP_MERGE_S = 1e-5  # token times of one step are the same instant; rounding in the record is 1 us


@dataclass
class DemoRecord:
    request_id: str
    prompt: str
    prompt_tokens: int
    output_tokens: int
    stages: dict[str, float]
    ttft_s: float
    e2e_s: float
    tpot_s: float
    client_ttft_s: float
    client_e2e_s: float
    finish_reason: str
    output: str
    start_offset_s: float  # when the client sent it, seconds since the burst began
    lang: str = "en"
    received_offset_s: float | None = None  # when the server received it, seconds since the burst began
    timestamps: dict[str, float | None] = field(default_factory=dict)  # the record's, relative to received
    token_times: list[float] = field(default_factory=list)  # relative to received
    token_sent: list[float] = field(default_factory=list)  # relative to received
    cached_prompt_tokens: int = 0
    preemptions: int = 0

    @property
    def origin(self) -> float:
        return self.received_offset_s if self.received_offset_s is not None else self.start_offset_s

    def at(self, name: str) -> float | None:
        """A boundary of the record in seconds since the burst began (None if it never happened)."""
        t = self.timestamps.get(name)
        return None if t is None else self.origin + t

    @property
    def waiting_s(self) -> float:
        """From the first token made to the first token sent."""
        first, sent = self.timestamps.get("first_token"), self.timestamps.get("first_sent")
        return max(0.0, sent - first) if first is not None and sent is not None else 0.0


@dataclass
class Segment:
    stage: str
    start: float  # seconds since the burst began
    end: float
    note: str = ""


def clip(text: str, limit: int) -> str:
    """``text`` on one line, at most ``limit`` characters: cut at a word boundary where there is one, with "…"."""
    flat = " ".join(text.split())
    if len(flat) <= limit:
        return flat
    cut = flat[: limit - 1]
    space = cut.rfind(" ")
    if space >= limit // 2:  # a word boundary not too far back (Chinese has none: cut between characters)
        cut = cut[:space]
    return cut.rstrip(" ,.;:-") + "…"


def language(prompt: str) -> str:
    return "zh" if re.search(r"[\u4e00-\u9fff]", prompt) else "en"


# --- the engine's steps, gaps and segments -----------------------------------------------------------------------------
def step_ends(records: list[DemoRecord]) -> list[float]:
    """The ends of the engine's steps (seconds since the burst began): the distinct token times of all requests."""
    times = sorted(r.origin + t for r in records for t in r.token_times)
    out: list[float] = []
    for t in times:
        if not out or t - out[-1] > STEP_MERGE_S:
            out.append(t)
    return out


def gap_threshold(records: list[DemoRecord]) -> float:
    """A token interval above this is a gap: ``GAP_FACTOR`` times the burst's median interval between tokens."""
    itl = [b - a for r in records for a, b in zip(r.token_times, r.token_times[1:]) if b > a]
    return GAP_FACTOR * float(np.median(itl)) if itl else float("inf")


def prefill_spans(records: list[DemoRecord]) -> dict[str, tuple[float, float]]:
    spans = {}
    for r in records:
        start, end = r.at("scheduled"), r.at("first_token")
        if start is not None and end is not None and end > start:
            spans[r.request_id] = (start, end)
    return spans


def gap_note(rec: DemoRecord, start: float, end: float, steps: list[float],
             prefills: dict[str, tuple[float, float]]) -> str:
    """Why ``rec`` got no token between ``start`` and ``end``, from what the other requests' records show."""
    between = sum(1 for s in steps if start + STEP_MERGE_S < s < end - STEP_MERGE_S)
    # Prefills that ran inside the gap (a prefill ending with the step that opens the gap does not count).
    others = sum(1 for rid, (a, b) in prefills.items()
                 if rid != rec.request_id and a < end - STEP_MERGE_S and b > start + STEP_MERGE_S)
    parts = [f"no token for {(end - start) * 1000:.0f} ms"]
    if others:
        parts.append(f"the engine was computing the prompts of {others} other request{'s' * (others != 1)}")
    if between:
        parts.append(f"{between} engine step{'s' * (between != 1)} ended without a token for this request "
                     "(paused or preempted)")
    if not others and not between:
        parts.append("one long engine step with no other request's prompt in it (the cores were taken by something "
                     "else: another process, or this one's own HTTP and Python work)")
    return parts[0] + ": " + "; ".join(parts[1:])


def segments(rec: DemoRecord, steps: list[float], threshold: float,
             prefills: dict[str, tuple[float, float]]) -> list[Segment]:
    """``rec``'s time, end to end, as drawn: tokenize, queue, prefill by step, decode by token (gaps apart), stream."""
    b = {k: rec.at(k) for k in ("received", "tokenized", "scheduled", "first_token", "last_token", "last_byte")}
    if b["received"] is None or b["last_byte"] is None:
        return []
    # A boundary that never happened takes the next one that did (as the server's stages do).
    order = ["received", "tokenized", "scheduled", "first_token", "last_token", "last_byte"]
    for i, k in enumerate(order):
        if b[k] is None:
            b[k] = next((b[n] for n in order[i + 1:] if b[n] is not None), b["last_byte"])
    out: list[Segment] = []

    def add(stage: str, a: float, z: float, note: str = "") -> None:
        if z > a:
            out.append(Segment(stage, a, z, note))

    add("tokenize", b["received"], b["tokenized"])
    add("queue", b["tokenized"], b["scheduled"])
    inner = [s for s in steps if b["scheduled"] + STEP_MERGE_S < s < b["first_token"] - STEP_MERGE_S]
    cuts = [b["scheduled"], *inner, b["first_token"]]
    for k, (a, z) in enumerate(zip(cuts, cuts[1:])):
        add("prefill", a, z, f"engine step {k + 1} of {len(cuts) - 1}")
    times = [rec.origin + t for t in rec.token_times]
    if not times:  # a record without token times: decode as one span
        add("decode", b["first_token"], b["last_token"])
    for k, (a, z) in enumerate(zip(times, times[1:])):
        if z - a > threshold:
            add("decode gap", a, z, f"token {k + 2}: " + gap_note(rec, a, z, steps, prefills))
        else:
            add("decode", a, z, f"token {k + 2}")
    add("stream", b["last_token"], b["last_byte"])
    return out


def split(rec: DemoRecord, segs: list[Segment]) -> dict[str, float]:
    """Seconds per drawn stage (adds up to E2E) and, apart, the first tokens' wait before leaving the server."""
    totals = dict.fromkeys(SEGMENT_STAGES, 0.0)
    for s in segs:
        totals[s.stage] += s.end - s.start
    totals["waiting"] = rec.waiting_s
    totals["prefill steps"] = sum(1 for s in segs if s.stage == "prefill")
    totals["gaps"] = sum(1 for s in segs if s.stage == "decode gap")
    return totals


def explain_request(rec: DemoRecord, segs: list[Segment]) -> str:
    """One sentence: where this request's TTFT and E2E went."""
    t = split(rec, segs)
    ms = lambda s: f"{s * 1000:.0f} ms"  # noqa: E731
    parts = [f"tokenize {ms(t['tokenize'])}", f"queue {ms(t['queue'])}",
             f"prefill {ms(t['prefill'])} over {t['prefill steps']} engine step{'s' * (t['prefill steps'] != 1)}"]
    text = f"{rec.request_id} ({rec.lang}): TTFT {ms(rec.ttft_s)} = " + ", ".join(parts)
    if t["waiting"] >= 0.001:
        text += (f", then its first tokens waited {ms(t['waiting'])} before the first left the server (an incomplete "
                 "character or a possible stop string)")
    text += f"; E2E {ms(rec.e2e_s)}, of which decode {ms(t['decode'] + t['decode gap'])} for {rec.output_tokens} tokens"
    gaps = [s for s in segs if s.stage == "decode gap"]
    if gaps:
        worst = max(gaps, key=lambda s: s.end - s.start)
        text += (f" with {len(gaps)} gap{'s' * (len(gaps) != 1)} ({ms(t['decode gap'])} in all; the longest, "
                 f"{worst.note.split(': ', 1)[1]})")
    return text + "."


# --- the machine -------------------------------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _gpus() -> list[str]:
    """GPUs the machine has (NVIDIA's driver files, else ``nvidia-smi -L``); empty when none is found."""
    names = []
    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        try:
            model = next((ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines()
                          if ln.startswith("Model:")), None)
        except OSError:
            model = None
        names.append(model or "NVIDIA GPU")
    if not names and shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=5).stdout
            names = [ln.split(":", 1)[1].split("(")[0].strip() for ln in out.splitlines() if ln.startswith("GPU")]
        except (OSError, subprocess.SubprocessError):
            pass
    return names


def hardware(device: str) -> dict[str, Any]:
    """The machine the demo ran on, and what of it the engine used."""
    from tailguard.engine import threads as thread_settings

    info: dict[str, Any] = {"cpu_model": _cpu_model(), "logical_cpus": os.cpu_count(), "device": device,
                            "gpus": _gpus()}
    try:
        info["usable_cpus"] = len(os.sched_getaffinity(0))
    except AttributeError:
        info["usable_cpus"] = os.cpu_count()
    info["cpu_quota"] = thread_settings.cgroup_cpu_limit()
    try:
        from tailguard.engine import kernels

        if kernels.available():
            info["compute_threads"] = kernels.num_threads()
            info["simd"] = kernels.simd()
    except Exception:  # noqa: BLE001 - the kernels are optional (the torch runner): say less
        pass
    with contextlib.suppress(ValueError, OSError, AttributeError):
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return info


def describe_hardware(hw: dict[str, Any]) -> str:
    cores = f"{hw.get('usable_cpus')} of {hw.get('logical_cpus')} logical CPUs usable"
    if hw.get("cpu_quota"):
        cores += f", a CPU quota of {hw['cpu_quota']:g} cores"
    text = f"{hw.get('cpu_model')} ({cores}"
    if hw.get("compute_threads"):
        text += f"; {hw['compute_threads']} compute threads"
    if hw.get("simd"):
        text += f", {hw['simd']}"
    if hw.get("memory_gib"):
        text += f"; {hw['memory_gib']:g} GiB memory"
    text += "); GPU: " + (", ".join(hw["gpus"]) if hw.get("gpus") else "none found")
    return text + f"; the model ran on the {str(hw.get('device', 'cpu')).upper()}"


# --- the host's other load ---------------------------------------------------------------------------------------------
def parse_proc_stat(text: str) -> dict[str, int]:
    """The aggregate ``cpu`` line of /proc/stat, in clock ticks: busy (user, nice, system, irq, softirq), idle
    (idle, iowait) and steal (time the hypervisor gave this VM's CPUs to someone else)."""
    for line in text.splitlines():
        if line.startswith("cpu "):
            v = [int(x) for x in line.split()[1:]] + [0] * 10
            return {"busy": v[0] + v[1] + v[2] + v[5] + v[6], "idle": v[3] + v[4], "steal": v[7]}
    raise ValueError("no aggregate cpu line in /proc/stat")


class HostLoad:
    """What the rest of the host used while something ran: all CPUs' busy time minus this process's own CPU time.

    The demo's server, engine, client and bench all run in this process, so "others" is every other program on the
    machine (another build, a test run, an editor), which competes with the engine for the same cores."""

    def __init__(self) -> None:
        self._start: tuple[float, dict[str, int], float] | None = None
        self.result: dict[str, float] | None = None

    @staticmethod
    def _snapshot() -> tuple[float, dict[str, int], float] | None:
        try:
            stat = parse_proc_stat(Path("/proc/stat").read_text())
        except (OSError, ValueError):
            return None  # not Linux: no figures
        t = os.times()
        return time.monotonic(), stat, t.user + t.system

    def __enter__(self) -> HostLoad:
        self._start = self._snapshot()
        return self

    def __exit__(self, *exc: object) -> None:
        self.result = self.measure()

    def measure(self) -> dict[str, float] | None:
        end = self._snapshot()
        if self._start is None or end is None:
            return None
        return load_between(self._start, end, os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1)


def load_between(start: tuple[float, dict[str, int], float], end: tuple[float, dict[str, int], float], hz: int,
                 cpus: int) -> dict[str, float]:
    """Cores used on average between two snapshots (monotonic time, /proc/stat ticks, own CPU seconds)."""
    wall = max(end[0] - start[0], 1e-9)
    busy = (end[1]["busy"] - start[1]["busy"]) / hz
    steal = (end[1]["steal"] - start[1]["steal"]) / hz
    own = end[2] - start[2]
    return {"wall_s": wall, "cpus": cpus, "host_busy_cores": busy / wall, "own_cores": own / wall,
            "others_cores": max(0.0, busy - own) / wall, "steal_cores": steal / wall}


def describe_load(load: dict[str, float] | None, what: str) -> str:
    if not load:
        return f"the host's load during {what} could not be read (no /proc/stat)"
    if load["wall_s"] < 0.2:  # /proc/stat counts in clock ticks (10 ms): too coarse for a shorter span
        return f"{what} was too short ({load['wall_s'] * 1000:.0f} ms) to measure the host's load"
    text = (f"during {what} ({load['wall_s']:.1f} s) this process used {load['own_cores']:.2f} cores and other "
            f"processes {load['others_cores']:.2f} of the {load['cpus']} cores")
    if load["steal_cores"] >= 0.05:
        text += f"; the hypervisor took {load['steal_cores']:.2f} cores (steal)"
    if load["others_cores"] >= 0.25:
        text += ": the figures measured then include that competition"
    return text


# --- why the SLO profiles fail -----------------------------------------------------------------------------------------
def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def explain_slo(bench: dict[str, Any], hw: dict[str, Any]) -> list[str]:
    """Plain sentences on the bench's SLO verdicts: which checks failed, and what on this machine makes them fail."""
    slo = bench.get("slo") or {}
    if not slo:
        return []
    failed = {name: [c for c in (p.get("checks") or []) if c.get("status") == "fail"] for name, p in slo.items()}
    lines = []
    verdicts = ", ".join(f"{name} {'PASS' if p.get('pass') else 'FAIL'}" for name, p in slo.items())
    device = str(hw.get("device", "cpu")).upper()
    gpu = ", ".join(hw.get("gpus") or []) or "no GPU"
    missed = any(failed.values())
    lines.append(
        f"SLO verdicts: {verdicts}. The profiles are written for serving on a GPU, where a decode step of a small "
        f"batch takes milliseconds; this run is on the {device} ({hw.get('usable_cpus')} cores, {gpu}), with the "
        "load generator on the same cores, so the verdicts say how far this machine is from GPU-class bounds"
        + ("; the lines below say which figures miss them and why." if missed else
           ": this run met them all, with the bench's light load (a busier host or a heavier load would not)."))
    share = _get(bench, "stages", "share_of_e2e")
    if isinstance(share, dict) and share:
        labels = _get(bench, "stages", "labels") or {}
        top = sorted(share.items(), key=lambda kv: -kv[1])[:3]
        lines.append("Where the bench's requests spent their time: " + ", ".join(
            f"{labels.get(k, k)} {v:.0%}" for k, v in top) + " of E2E (the bench report's stage breakdown).")
    tpot = _get(bench, "metrics", "tpot", "percentiles", "p50", "value")
    out_tokens = _get(bench, "run", "workload", "output_tokens")
    seen: set[str] = set()
    for checks in failed.values():
        for c in checks:
            name = c.get("objective", "")
            if name in seen or c.get("value_s") is None or c.get("threshold_s") is None:
                continue
            seen.add(name)
            value, bound = c["value_s"], c["threshold_s"]
            line = f"{name}: measured {value * 1000:.0f} ms, {value / bound:.1f}x the bound"
            if c.get("metric") == "e2e" and tpot and out_tokens:
                floor = (out_tokens - 1) * tpot
                line += (f". At {tpot * 1000:.0f} ms per output token (TPOT P50) a {out_tokens}-token answer spends "
                         f"{floor * 1000:.0f} ms in decode alone")
                line += (", already over the bound before any prefill or queueing: no scheduling meets it on this "
                         "hardware" if floor >= bound else f", leaving {(bound - floor) * 1000:.0f} ms for the rest")
            elif c.get("metric") == "ttft":
                prefill = _get(bench, "stages", "mean_s", "prefill")
                queue = _get(bench, "stages", "mean_s", "queue")
                if prefill is not None and queue is not None:
                    line += (f". A prompt's prefill took {prefill * 1000:.0f} ms on average and its queue wait "
                             f"{queue * 1000:.0f} ms: a request that arrives while another's prompt computes waits "
                             "for that step, and on a CPU that step is long")
            lines.append(line + ".")
    return lines


# --- the report --------------------------------------------------------------------------------------------------------
def burst_figure(records: list[DemoRecord]):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    steps = step_ends(records)
    threshold = gap_threshold(records)
    prefills = prefill_spans(records)
    fig = make_subplots(rows=2, cols=1, row_heights=[0.78, 0.22], vertical_spacing=0.12,
                        subplot_titles=("Each request as the server recorded it (seconds since the burst began)",
                                        "Share of all end-to-end time by stage"))
    bars: dict[str, dict[str, list]] = {s: {"y": [], "x": [], "base": [], "text": []} for s in SEGMENT_STAGES}
    totals = dict.fromkeys(SEGMENT_STAGES, 0.0)
    held: dict[str, list] = {"y": [], "x": [], "base": [], "text": []}
    sent_x: list[float] = []
    sent_y: list[float] = []
    ttft_x: list[float] = []
    ttft_y: list[float] = []
    for i, r in enumerate(records):
        for s in segments(r, steps, threshold, prefills):
            b = bars[s.stage]
            b["y"].append(i)
            b["x"].append(s.end - s.start)
            b["base"].append(s.start)
            b["text"].append(f"{r.request_id} {s.stage}: {(s.end - s.start) * 1000:.0f} ms"
                             + (f" ({s.note})" if s.note else ""))
            totals[s.stage] += s.end - s.start
        first, first_sent = r.at("first_token"), r.at("first_sent")
        if first is not None and first_sent is not None and first_sent - first >= 0.001:
            held["y"].append(i + 0.4)
            held["x"].append(first_sent - first)
            held["base"].append(first)
            held["text"].append(f"{r.request_id} waiting: {(first_sent - first) * 1000:.0f} ms ({STAGE_HELP['waiting']})")
        sent = sorted({round(r.origin + t, 5) for t in r.token_sent})
        sent_x += sent
        sent_y += [i + 0.4] * len(sent)
        if first_sent is not None:
            ttft_x.append(first_sent)
            ttft_y.append(i)
    for stage in SEGMENT_STAGES:
        b = bars[stage]
        fig.add_trace(go.Bar(y=b["y"], x=b["x"], base=b["base"], orientation="h", name=stage, width=0.6,
                             marker={"color": STAGE_COLORS[stage], "line": {"color": "white", "width": 0.6}},
                             hovertext=b["text"], hovertemplate="%{hovertext}<extra></extra>",
                             legendrank=SEGMENT_STAGES.index(stage)), row=1, col=1)
    fig.add_trace(go.Bar(y=held["y"], x=held["x"], base=held["base"], orientation="h", width=0.16,
                         name="waiting (made, not sent)", marker_color=STAGE_COLORS["waiting"],
                         hovertext=held["text"], hovertemplate="%{hovertext}<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Scatter(x=sent_x, y=sent_y, mode="markers", name="token sent",
                             marker={"symbol": "line-ns", "size": 7, "line": {"width": 1, "color": "#333"}},
                             hovertemplate="sent at %{x:.3f} s<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Scatter(x=ttft_x, y=ttft_y, mode="markers", name="first token sent (TTFT)",
                             marker={"symbol": "diamond", "size": 8, "color": "black"},
                             hovertemplate="first token sent at %{x:.3f} s<extra></extra>"), row=1, col=1)
    whole = sum(totals.values()) or 1.0
    fig.add_trace(go.Bar(x=list(totals), y=[v / whole for v in totals.values()], showlegend=False,
                         marker_color=[STAGE_COLORS[s] for s in totals],
                         hovertemplate="%{x}: %{y:.1%}<extra></extra>"), row=2, col=1)
    fig.update_yaxes(autorange="reversed", tickmode="array", tickvals=list(range(len(records))),
                     ticktext=[f"{r.request_id} ({r.lang})" for r in records], row=1, col=1)
    fig.update_yaxes(tickformat=".0%", row=2, col=1)
    fig.update_xaxes(title_text="seconds since the burst began", row=1, col=1)
    fig.update_layout(barmode="overlay", height=420 + 30 * len(records), margin={"l": 180},
                      title="A burst of concurrent chat requests through tailguard serve")
    return fig


CSS = """
body{font-family:sans-serif;max-width:1300px;margin:auto;padding:0 1em}
table{border-collapse:collapse;font-size:13px} td,th{border:1px solid #ccc;padding:3px 6px}
td.num{text-align:right} td.id,th{white-space:nowrap} td.out{max-width:360px}
.note{color:#444} li{margin:.2em 0}
"""


def sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + "."


def _ms(s: float) -> str:
    return f"{s * 1000:.0f}"


def request_rows(records: list[DemoRecord]) -> str:
    steps, threshold, prefills = step_ends(records), gap_threshold(records), prefill_spans(records)
    rows = []
    for r in records:
        t = split(r, segments(r, steps, threshold, prefills))
        cells = [f"<td class='id'>{html.escape(r.request_id)}</td>", f"<td>{r.lang}</td>",
                 f"<td class='num'>{r.prompt_tokens}" + (f" ({r.cached_prompt_tokens} cached)"
                                                          if r.cached_prompt_tokens else "") + "</td>",
                 f"<td class='num'>{r.output_tokens}</td>",
                 f"<td class='num'>{_ms(t['tokenize'])}</td>", f"<td class='num'>{_ms(t['queue'])}</td>",
                 f"<td class='num'>{_ms(t['prefill'])} ({t['prefill steps']})</td>",
                 f"<td class='num'>{_ms(t['waiting'])}</td>",
                 f"<td class='num'>{_ms(t['decode'])}</td>",
                 f"<td class='num'>{_ms(t['decode gap'])} ({t['gaps']})</td>",
                 f"<td class='num'>{_ms(t['stream'])}</td>",
                 f"<td class='num'>{_ms(r.ttft_s)}</td>", f"<td class='num'>{_ms(r.e2e_s)}</td>",
                 f"<td class='out' title='{html.escape(r.output, quote=True)}'>{html.escape(clip(r.output, 90))}</td>"]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    head = ("<tr><th>id</th><th>lang</th><th>prompt tokens</th><th>out</th><th>tokenize</th><th>queue</th>"
            "<th>prefill (steps)</th><th>waiting</th><th>decode</th><th>decode gaps (count)</th><th>stream</th>"
            "<th>TTFT</th><th>E2E</th><th>output (hover for all of it)</th></tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def what_to_look_at(records: list[DemoRecord]) -> list[str]:
    """The requests worth a look, each with where its time went."""
    if not records:
        return []
    steps, threshold, prefills = step_ends(records), gap_threshold(records), prefill_spans(records)
    seg = {r.request_id: segments(r, steps, threshold, prefills) for r in records}
    worst_ttft = max(records, key=lambda r: r.ttft_s)
    worst_e2e = max(records, key=lambda r: r.e2e_s)
    lines = [f"Slowest first token: {explain_request(worst_ttft, seg[worst_ttft.request_id])}"]
    if worst_e2e is not worst_ttft:
        lines.append(f"Slowest end to end: {explain_request(worst_e2e, seg[worst_e2e.request_id])}")
    by_lang = {}
    for lang in ("en", "zh"):
        rs = [r for r in records if r.lang == lang]
        if rs:
            by_lang[lang] = (float(np.median([r.ttft_s for r in rs])), float(np.median([r.waiting_s for r in rs])))
    if len(by_lang) == 2:
        (en_t, en_w), (zh_t, zh_w) = by_lang["en"], by_lang["zh"]
        line = (f"Language: TTFT median {en_t * 1000:.0f} ms in English, {zh_t * 1000:.0f} ms in Chinese; the first "
                f"tokens waited (made, not yet sent) {en_w * 1000:.0f} ms and {zh_w * 1000:.0f} ms")
        if zh_w > en_w + 0.01:
            line += (": a Chinese character often takes several tokens, and none is sent until the character is "
                     "whole, so the Chinese answers' TTFT includes a few decode steps")
        lines.append(line + ".")
    return lines


def write_report(records: list[DemoRecord], summary: dict, path: Path, bench_report: Path | None,
                 bench: dict[str, Any] | None = None) -> None:
    fig = burst_figure(records)
    hw = summary.get("hardware") or {}
    stats = "".join(f"<li>{k}: P50 {v['p50'] * 1000:.0f} ms, P95 {v['p95'] * 1000:.0f} ms, "
                    f"P99 {v['p99'] * 1000:.0f} ms</li>" for k, v in summary["percentiles"].items())
    shows = [f"Hardware: {describe_hardware(hw)}." if hw else "",
             sentence(describe_load(summary.get("host_load"), "the burst")),
             summary.get("warmup_note", "")]
    shows += explain_slo(bench, hw) if bench else []
    legend = "".join(f"<li><b style='color:{STAGE_COLORS[s]}'>{s}</b>: {STAGE_HELP[s]}</li>"
                     for s in (*SEGMENT_STAGES, "waiting"))
    bench_html = (f"<h2>Load test</h2><p>The bench run against the same server: <a href='{bench_report.as_posix()}'>"
                  f"{html.escape(bench_report.as_posix())}</a> (CDFs, latency over time, stage breakdown, SLO "
                  "verdicts); what its SLO verdicts mean on this machine is under \"What this run shows\" above.</p>"
                  ) if bench_report else ""
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>tailguard demo</title>"
        f"<style>{CSS}</style></head><body>"
        f"<h1>tailguard demo</h1><p>{summary['requests']} concurrent streaming chat requests to "
        f"<code>tailguard serve</code> on {html.escape(summary['model'])} ({html.escape(str(summary['weight_format']))}, "
        f"{html.escape(str(summary['device']))}); {summary['output_tokens']} tokens in {summary['wall_s']:.2f} s = "
        f"{summary['tokens_per_s']:.1f} tokens/s. Every time below is from the server's own timeline "
        "(docs/metrics.md).</p>"
        "<h2>What this run shows</h2><ul>" + "".join(f"<li>{html.escape(s)}</li>" for s in shows if s)
        + "</ul><h2>What to look at</h2><ul>"
        + "".join(f"<li>{html.escape(s)}</li>" for s in what_to_look_at(records))
        + "<li>In the chart, each row is one request: hover a segment for its stage, its time and, for a gap, why "
          "the request got no token. The thin lane under a row marks each token as it left the server; the black "
          "diamond is the first (the TTFT the client saw).</li></ul>"
        + f"<ul>{stats}</ul>" + fig.to_html(full_html=False, include_plotlyjs=True)
        + f"<h3>Stages</h3><ul class='note'>{legend}</ul>" + bench_html
        + "<h2>Requests (ms)</h2>" + request_rows(records) + "</body></html>"
    )
    path.write_text(page, encoding="utf-8")
