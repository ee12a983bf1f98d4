"""``tailguard bench ab``: one schedule against two or more arms, in alternating repeats, written up in one report.

An arm is an OpenAI-compatible endpoint: a URL used as is, or a command that starts one (``{port}`` is filled with a
free 127.0.0.1 port), started before each of its repeats, waited for until healthy, and stopped after (SIGTERM, then
SIGKILL after a grace), its output kept in the run folder. Every arm gets the identical schedule: one workload and one
arrival plan are built once and replayed at every run (the same arrivals, prompts and traffic classes; a class follows
the arrival's index and --seed alone), and each run records a fingerprint of what it sent, so the report can show it.
Repeats alternate (A B B A A B ...), so that slow drift of a shared machine falls on every arm alike.

Per arm: its repeats' requests pooled (percentiles with bootstrap CIs, goodput, verdicts, where the time went), each
repeat's own percentiles (the run-to-run spread), the cost in replica-seconds (a tailguard gateway's own counter when
it exports one, else the declared replicas times the run's wall time) and, with --sweep-scales, the highest time scale
at which it meets the SLO. With --gate each arm is compared with the first by the rules of ``bench compare --gate``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np

from tailguard.bench.redact import (
    MASK,
    command_line,
    redact_argv,
    redact_url,
    scrub,
    secret_header,
    secret_values,
)

__all__ = ["Arm", "ArmError", "ArmProcess", "RunSlot", "arms_from_args", "parse_arm", "parse_replica_seconds",
           "plan_runs", "run_ab", "run_ab_sync", "scales_from"]

SCHEMA = "tailguard.bench.ab/v1"
ARM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# /ready first: a server that has it (tailguard) answers /health while its model is still loading
HEALTH_PATHS = ("/ready", "/health", "/v1/models")
URL_CHECK_S = 5.0  # a URL arm is running already: it answers within this or it is unreachable
FIGURE_METRICS = ("ttft", "itl", "tpot", "e2e")
FIGURE_PCTS = ("p50", "p95", "p99")
LOG_TAIL_LINES = 3


class ArmError(Exception):
    """An arm that cannot be reached, started or made healthy: one line on stderr, exit code 2."""


# --- arms -----------------------------------------------------------------------------------------------------

@dataclass
class Arm:
    name: str
    url: str | None = None  # a running endpoint, used as is
    command: str | None = None  # a command that starts one; {port} (and {host}) filled in at each start
    replicas: int = 1  # declared: what its cost counts when the endpoint does not export its own
    headers: dict[str, str] = field(default_factory=dict)
    api_key: str | None = None
    key_env: str | None = None
    model: str | None = None

    @property
    def kind(self) -> str:
        return "command" if self.command is not None else "url"

    def secrets(self) -> list[str]:
        return secret_values(self.api_key, self.headers, self.url)

    def describe(self) -> dict[str, Any]:
        """For results.json: no key and no credential header value, only whether one was set."""
        d: dict[str, Any] = {"name": self.name, "kind": self.kind, "replicas_declared": self.replicas,
                             "model": self.model, "key": MASK if self.api_key else None, "key_env": self.key_env,
                             "headers": {k: (MASK if secret_header(k) else v) for k, v in self.headers.items()}}
        if self.url is not None:
            d["url"] = redact_url(self.url)
        if self.command is not None:
            d["command"] = shlex.join(redact_argv(shlex.split(self.command)))
        return d


def _base_url(url: str) -> str:
    u = urlparse(url)
    if u.scheme not in ("http", "https") or not u.netloc:
        raise ValueError(url)
    base = url.rstrip("/")
    for suffix in ("/v1/chat/completions", "/v1/completions", "/v1"):  # a pasted API path is cut back to the base
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base


def parse_arm(text: str) -> Arm:
    """``before=http://127.0.0.1:8001`` or ``after=cmd:tailguard serve --port {port}`` -> an Arm."""
    name, sep, target = text.partition("=")
    name, target = name.strip(), target.strip()
    if not sep or not name or not target:
        raise ValueError(f"--arm wants NAME=URL or NAME=cmd:COMMAND, got {redact_url(text)!r}")
    if not ARM_NAME.match(name):
        raise ValueError(f"an arm name is letters, digits, '_', '.' or '-' (got {name!r})")
    if target.startswith("cmd:"):
        command = target[4:].strip()
        try:
            argv = shlex.split(command)
        except ValueError as exc:
            raise ValueError(f"arm {name!r}: cannot split its command into words ({exc})") from None
        if not argv:
            raise ValueError(f"arm {name!r}: cmd: needs a command, e.g. cmd:tailguard serve --port {{port}}")
        if shutil.which(argv[0]) is None:  # found now, not after the other arms' first runs
            raise ValueError(f"arm {name!r}: cannot find the program {argv[0]!r} of its command (not a file, or not "
                             "on PATH)")
        if not any("{port}" in a for a in argv):
            raise ValueError(f"arm {name!r}: the command must say where its port goes with {{port}} (e.g. --port "
                             "{port}), so that the bench can give it a free port and find it there")
        return Arm(name, command=command)
    try:
        return Arm(name, url=_base_url(target))
    except ValueError:
        raise ValueError(f"arm {name!r}: {redact_url(target)!r} is neither an http(s) URL such as "
                         "http://127.0.0.1:8000 nor cmd:COMMAND") from None


def _pairs(flag: str, items: Sequence[str], secret: bool = False) -> list[tuple[str, str]]:
    out = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            shown = MASK if secret else item
            raise ValueError(f"{flag} wants NAME=VALUE with an arm's name first, got {shown!r}")
        out.append((name.strip(), value.strip()))
    return out


def arms_from_args(specs: Sequence[str], replicas: Sequence[str] = (), headers: Sequence[str] = (),
                   keys: Sequence[str] = (), key_envs: Sequence[str] = (), models: Sequence[str] = ()) -> list[Arm]:
    """The arms of repeated --arm flags with their per-arm options; a ValueError says what is wrong."""
    arms = [parse_arm(s) for s in specs]
    if len(arms) < 2:
        raise ValueError(f"an A/B run needs at least two arms (--arm NAME=URL or --arm NAME=cmd:COMMAND), got "
                         f"{len(arms)}")
    by: dict[str, Arm] = {}
    for a in arms:
        if a.name in by:
            raise ValueError(f"two arms are named {a.name!r}: each arm needs its own name")
        by[a.name] = a

    def arm(flag: str, name: str) -> Arm:
        if name not in by:
            raise ValueError(f"{flag} names the arm {name!r}, which no --arm defines (arms: {', '.join(by)})")
        return by[name]

    for name, v in _pairs("--replicas", replicas):
        try:
            n = int(v)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"--replicas {name}=N wants a whole number of replicas, at least 1; got {v!r}")
        arm("--replicas", name).replicas = n
    for name, v in _pairs("--arm-header", headers):
        h, sep, value = v.partition(":")
        if not sep or not h.strip():
            raise ValueError(f"--arm-header wants NAME=HEADER:VALUE, got {name}={_masked_header(v)!r}")
        arm("--arm-header", name).headers[h.strip()] = value.strip()
    for name, v in _pairs("--arm-key", keys, secret=True):
        if not v:
            raise ValueError(f"--arm-key {name}= gives an empty key")
        arm("--arm-key", name).api_key = v
    for name, var in _pairs("--arm-key-env", key_envs):
        a = arm("--arm-key-env", name)
        if a.api_key:
            raise ValueError(f"arm {name!r}: give its key with --arm-key or --arm-key-env, not both")
        if not os.environ.get(var):
            raise ValueError(f"arm {name!r}: the environment variable {var} (--arm-key-env) is not set")
        a.api_key, a.key_env = os.environ[var], var
    for name, v in _pairs("--arm-model", models):
        if not v:
            raise ValueError(f"--arm-model {name}= gives no model name")
        arm("--arm-model", name).model = v
    return arms


def _masked_header(v: str) -> str:
    h, sep, _ = v.partition(":")
    return f"{h}:{MASK}" if sep and secret_header(h) else v


# --- the order of the runs ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunSlot:
    position: int  # 1-based, in running order
    arm: str
    repeat: int  # 1-based, per arm and time scale
    scale: float  # the time scale of the schedule (the main one, or one of --sweep-scales)
    main: bool  # the main scale: its runs make the report's figures


def scales_from(text: str | None) -> tuple[float, ...]:
    """``1,2,4`` -> (1.0, 2.0, 4.0), sorted and without repeats; empty: no sweep."""
    if not text:
        return ()
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or any(not (math.isfinite(v) and v > 0) for v in vals):
        raise ValueError(f"--sweep-scales takes a comma list of positive time scales such as 1,2,4; got {text!r}")
    return tuple(sorted(set(vals)))


def plan_runs(arms: Sequence[str], repeats: int, order: str = "abba", main_scale: float = 1.0,
              scales: Sequence[float] = (), sweep_repeats: int = 1) -> list[RunSlot]:
    """The runs in order. ``abba``: every other round reverses the arms (A B, B A, A B ...), so that a machine that
    slowly drifts (heats up, fills a cache, gets a noisy neighbour) weighs on every arm alike; ``abab``: the same order
    every round. The main scale's repeats come first, then each other swept scale's."""
    slots: list[RunSlot] = []

    def rounds(n: int, scale: float, main: bool) -> None:
        count = dict.fromkeys(arms, 0)
        for r in range(n):
            seq = list(arms) if order == "abab" or r % 2 == 0 else list(arms)[::-1]
            for a in seq:
                count[a] += 1
                slots.append(RunSlot(len(slots) + 1, a, count[a], scale, main))

    rounds(repeats, main_scale, True)
    for s in scales:
        if not math.isclose(s, main_scale):
            rounds(sweep_repeats, s, False)
    return slots


# --- command arms ---------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    tail = [x.strip() for x in text.splitlines() if x.strip()][-lines:]
    return " | ".join(t[:200] for t in tail)


async def _healthy(client, base: str, paths: Sequence[str], headers: dict[str, str]) -> tuple[bool, str]:
    """(healthy, what was seen). A server with /ready must answer it 200; else /health, else /v1/models."""
    import httpx

    seen = []
    for p in paths:
        try:
            r = await client.get(base + p, headers=headers)
        except httpx.HTTPError as exc:
            return False, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if r.status_code == 200:
            return True, f"GET {p}: 200"
        seen.append(f"GET {p}: {r.status_code}")
        if p == "/ready" and r.status_code not in (404, 405):
            return False, seen[-1]  # it has /ready, and it says not yet
    return False, "; ".join(seen)


class ArmProcess:
    """One command arm's server for one run, in a process group of its own so that stopping it stops its children."""

    def __init__(self, arm: Arm, log_path: Path) -> None:
        assert arm.command is not None
        self.arm = arm
        self.log_path = log_path
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.ready_s: float | None = None
        self._log = None
        self.stopped: dict[str, Any] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        assert self.arm.command is not None
        return [a.replace("{port}", str(self.port)).replace("{host}", "127.0.0.1")
                for a in shlex.split(self.arm.command)]

    def start(self) -> None:
        argv = self.argv()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        except OSError as exc:
            self._log.close()
            raise ArmError(f"arm {self.arm.name!r}: cannot start {argv[0]!r}: {exc.strerror or exc}") from None
        self.started = time.monotonic()

    async def wait_healthy(self, timeout: float, path: str | None, headers: dict[str, str]) -> float:
        """Seconds from the start to healthy; an ArmError when it exits first or does not get there in time."""
        import httpx

        assert self.proc is not None
        paths = (path,) if path else HEALTH_PATHS
        deadline = self.started + timeout
        seen = "no answer yet"
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise ArmError(f"arm {self.arm.name!r}: its command exited with status {code} before it became "
                                   f"healthy; its output is in {self.log_path}{self._tail()}")
                ok, seen = await _healthy(client, self.url, paths, headers)
                if ok:
                    self.ready_s = time.monotonic() - self.started
                    return self.ready_s
                if time.monotonic() > deadline:
                    raise ArmError(f"arm {self.arm.name!r}: its command did not become healthy within {timeout:g} s "
                                   f"(GET {', '.join(paths)} on {self.url}; last: {seen}); its output is in "
                                   f"{self.log_path}{self._tail()}")
                await asyncio.sleep(0.1)

    def _tail(self) -> str:
        if self._log is not None:
            with contextlib.suppress(OSError, ValueError):
                self._log.flush()
        tail = _log_tail(self.log_path)
        return f" (last lines: {tail})" if tail else " (it printed nothing)"

    def _signal(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)  # the group this process leads (start_new_session): it and its children

    def stop(self, grace: float) -> dict[str, Any]:
        """SIGTERM to its process group, SIGKILL after ``grace`` seconds; idempotent."""
        if self.stopped is not None or self.proc is None:
            return self.stopped or {}
        t0 = time.monotonic()
        how = "exited by itself"
        if self.proc.poll() is None:
            how = "SIGTERM"
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                how = "SIGKILL"
        self._signal(signal.SIGKILL)  # whatever of its group is left (children that ignored SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        if self._log is not None:
            self._log.close()
        self.stopped = {"pid": self.proc.pid, "port": self.port, "ready_s": self.ready_s, "stopped_by": how,
                        "exit_status": self.proc.returncode, "stop_s": time.monotonic() - t0,
                        "alive_s": time.monotonic() - self.started}
        return self.stopped


# --- replica-seconds ------------------------------------------------------------------------------------------

_REPLICA_METRIC = re.compile(r"^tailguard_gateway_replica_seconds_total(?:\{[^}]*\})?\s+(\S+)", re.MULTILINE)


def parse_replica_seconds(text: str) -> float | None:
    """The sum of ``tailguard_gateway_replica_seconds_total`` over its series (every source, every model) in a
    Prometheus text page; None when the page has none."""
    vals = []
    for m in _REPLICA_METRIC.finditer(text):
        try:
            v = float(m.group(1))
        except ValueError:
            continue
        if math.isfinite(v):
            vals.append(v)
    return sum(vals) if vals else None


async def scrape_replica_seconds(client, base: str, headers: dict[str, str],
                                 admin_key: str | None) -> tuple[float | None, str | None]:
    """(replica-seconds so far, where read) from a tailguard gateway: /metrics, else /admin/upstreams (admin key)."""
    import httpx

    with contextlib.suppress(httpx.HTTPError):
        r = await client.get(base + "/metrics", headers=headers)
        if r.status_code == 200:
            v = parse_replica_seconds(r.text)
            if v is not None:
                return v, "/metrics"
    if admin_key:
        with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError):
            r = await client.get(base + "/admin/upstreams", headers={"Authorization": f"Bearer {admin_key}"})
            if r.status_code == 200:
                total = ((r.json() or {}).get("replica_seconds") or {}).get("total")
                if isinstance(total, int | float) and math.isfinite(total):
                    return float(total), "/admin/upstreams"
    return None, None


# --- the identical schedule -----------------------------------------------------------------------------------

class _Recorder:
    """The shared workload, noting a digest of each request it hands out, so that each run can show what it sent."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seen: dict[int, str] = {}

    @property
    def base(self) -> Any:  # what decides the schedule (runner._base): the workload under the classes, if any
        return getattr(self.inner, "base", self.inner)

    def spec(self, i: int):
        s = self.inner.spec(i)
        self.seen[i] = hashlib.sha256(json.dumps(
            [s.prompt, s.messages, s.max_tokens, s.traffic_class, s.business_type, s.user],
            ensure_ascii=False, default=str).encode("utf-8")).hexdigest()
        return s

    def __bool__(self) -> bool:  # a workload is there (a synthetic one has no length to test)
        return True

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, item: str) -> Any:
        if item in ("inner", "seen"):
            raise AttributeError(item)
        return getattr(self.inner, item)


def fingerprint(ms: Sequence[Any], seen: dict[int, str], offsets: np.ndarray | None) -> str:
    """A digest of what a run sent: each request's index, intended offset and content (prompt, max_tokens, class)."""
    h = hashlib.sha256()
    for m in sorted(ms, key=lambda m: m.index):
        off = f"{float(offsets[m.index]):.6f}" if offsets is not None and m.index < len(offsets) else "-"
        h.update(f"{m.index}|{off}|{seen.get(m.index, '?')}\n".encode())
    return h.hexdigest()[:16]


# --- pooling --------------------------------------------------------------------------------------------------

def _pv(metrics: dict, name: str, q: str) -> float | None:
    v = ((((metrics or {}).get(name) or {}).get("percentiles") or {}).get(q) or {}).get("value")
    return None if v is None else float(v)


def _reindexed(runs: Sequence[Sequence[Any]]) -> list[Any]:
    """The runs' requests in one list, each index made unique (repeat k's request i: k * stride + i), so that the
    ITL bootstrap keeps each request's gaps together rather than merging the same index of different repeats."""
    top = max((m.index for run in runs for m in run), default=0)
    stride = 10 ** len(str(top + 1))
    return [dataclasses.replace(m, index=k * stride + m.index) for k, run in enumerate(runs) for m in run]


def pool(runs: Sequence[tuple[dict, list]], cfg: Any, profiles: Sequence[Any], class_defs: Sequence[Any] | None,
         by_column: bool, column: str | None) -> tuple[dict, dict]:
    """(figures, samples) of one arm's runs pooled: percentiles with CIs over all their requests; rates over the sum
    of their windows; verdicts, stages and traffic classes as for one run."""
    from tailguard.bench.classes import analyse_classes
    from tailguard.bench.metrics import aggregate
    from tailguard.bench.profiles import evaluate
    from tailguard.bench.results import samples
    from tailguard.bench.stages import stage_report

    ms = _reindexed([m for _, m in runs])
    windows = [float(r["summary"].get("duration_s") or 0.0) for r, _ in runs]
    window = sum(w for w in windows if math.isfinite(w) and w > 0) or None
    failures_at = cfg.timeout if cfg.failures_as_timeout else None
    agg = aggregate(ms, reps=cfg.bootstrap, seed=cfg.seed, failures_at=failures_at, rate_window=window)
    win = agg.window
    slo = {p.name: evaluate(p, agg.measured, win, cfg.bootstrap, cfg.seed, shared=agg.metrics) for p in profiles}
    out: dict[str, Any] = {"summary": agg.summary, "metrics": agg.metrics, "slo": slo,
                           "stages": stage_report(agg.measured), "tokens": agg.tokens, "runs": len(runs)}
    if class_defs:
        out["classes"] = analyse_classes(class_defs, agg.measured, profiles, slo, win, cfg.bootstrap, cfg.seed,
                                         failures_at, by_column=by_column, column=column)
    return out, samples(agg.measured, cfg.seed, classes=bool(class_defs))


def spread(metric_tables: Sequence[dict]) -> dict:
    """Each run's P50/P95/P99 of TTFT, ITL, TPOT and E2E, and their min and max: the run-to-run spread."""
    out: dict[str, dict] = {}
    for k in FIGURE_METRICS:
        for q in FIGURE_PCTS:
            vals = [_pv(t, k, q) for t in metric_tables]
            got = [v for v in vals if v is not None]
            out.setdefault(k, {})[q] = {"values": vals, "min": min(got) if got else None,
                                        "max": max(got) if got else None}
    return out


def verdict(pooled: dict, profile: str | None = None) -> dict:
    """Whether pooled figures meet the SLO: every judged profile of the whole and every traffic class's verdict, or
    only ``profile`` (--sweep-profile) where it was judged."""
    judged: list[tuple[str, bool]] = []
    for name, v in (pooled.get("slo") or {}).items():
        if v.get("evaluated") and (profile is None or name == profile):
            judged.append((name, bool(v["pass"])))
    for cname, d in ((pooled.get("classes") or {}).get("by_class") or {}).items():
        if profile is None:
            if d.get("pass") is not None:
                judged.append((f"class {cname}", bool(d["pass"])))
        else:
            v = (d.get("slo") or {}).get(profile)
            if v and v.get("evaluated"):
                judged.append((f"class {cname} {profile}", bool(v["pass"])))
    return {"pass": all(ok for _, ok in judged) if judged else None,
            "judged": [n for n, _ in judged], "failed": [n for n, ok in judged if not ok],
            "profile": profile}


def _offered(plan: Any) -> float | None:
    from tailguard.bench.arrivals import achieved_rate

    if plan.mode != "open" or plan.offsets is None:
        return None
    offs = np.asarray(plan.offsets, dtype=float)
    if plan.num_requests is not None:
        offs = offs[: plan.num_requests]
    if plan.duration is not None:
        offs = offs[offs < plan.duration]
    r = achieved_rate(offs)
    return r if math.isfinite(r) else None


def _planned_requests(plan: Any) -> int | None:
    if plan.mode == "closed":
        return plan.num_requests
    offs = np.asarray(plan.offsets if plan.offsets is not None else [], dtype=float)
    n = len(offs) if plan.num_requests is None else min(plan.num_requests, len(offs))
    if plan.duration is not None:
        n = int(np.sum(offs[:n] < plan.duration))
    return n


# --- ratios against the baseline ------------------------------------------------------------------------------

def figures(arm: dict) -> dict[str, float | None]:
    """The figures of one arm that the ratio table divides by the baseline's (keys: ``ttft.p99``, ``goodput.strict``,
    ``cost.replica_seconds``...)."""
    p = arm["pooled"]
    f: dict[str, float | None] = {}
    for k in FIGURE_METRICS:
        for q in FIGURE_PCTS:
            f[f"{k}.{q}"] = _pv(p["metrics"], k, q)
    tp = (p["summary"].get("throughput") or {})
    f["throughput.requests_per_s"] = tp.get("requests_per_s")
    f["throughput.output_tokens_per_s"] = tp.get("output_tokens_per_s")
    f["error_rate"] = p["summary"].get("error_rate")
    for name, v in (p.get("slo") or {}).items():
        f[f"goodput.{name}"] = v.get("goodput_rps")
    f["cost.replica_seconds"] = arm["cost"]["replica_seconds"]
    f["cost.replica_seconds_per_1000_requests"] = arm["cost"]["per_1000_requests"]
    cap = arm.get("capacity") or {}
    if cap.get("swept"):
        f["capacity.best_scale"] = cap.get("best_scale")
        f["capacity.best_offered_rps"] = cap.get("best_offered_rps")
    return f


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or not math.isfinite(a) or not math.isfinite(b):
        return None
    return a / b


def _overlap(sa: dict | None, sb: dict | None) -> bool | None:
    """Whether two arms' run-to-run ranges [min, max] of a percentile overlap: a difference inside the spread."""
    if not sa or not sb or None in (sa.get("min"), sa.get("max"), sb.get("min"), sb.get("max")):
        return None
    return bool(sa["min"] <= sb["max"] and sb["min"] <= sa["max"])


def ratios(arms: dict[str, dict], baseline: str) -> dict[str, dict]:
    """Per arm but the baseline: each figure, the baseline's, their ratio (arm / baseline) and, for percentiles,
    whether the two arms' run-to-run ranges overlap; the same per traffic class both have."""
    base = arms[baseline]
    fb = figures(base)
    out: dict[str, dict] = {}
    for name, arm in arms.items():
        if name == baseline:
            continue
        fa = figures(arm)
        rows: dict[str, dict] = {}
        for key, b in fb.items():
            a = fa.get(key)
            row: dict[str, Any] = {"baseline": b, "arm": a, "ratio": _ratio(a, b)}
            metric, _, q = key.partition(".")
            if metric in FIGURE_METRICS:
                row["spread_overlap"] = _overlap(arm["spread"].get(metric, {}).get(q),
                                                 base["spread"].get(metric, {}).get(q))
            rows[key] = row
        classes: dict[str, dict] = {}
        cb = (base["pooled"].get("classes") or {}).get("by_class") or {}
        ca = (arm["pooled"].get("classes") or {}).get("by_class") or {}
        for cname in cb:
            if cname not in ca:
                continue
            crow: dict[str, dict] = {}
            for k in FIGURE_METRICS:
                for q in FIGURE_PCTS:
                    b, a = _pv(cb[cname]["metrics"], k, q), _pv(ca[cname]["metrics"], k, q)
                    crow[f"{k}.{q}"] = {"baseline": b, "arm": a, "ratio": _ratio(a, b)}
            for prof, v in (cb[cname].get("slo") or {}).items():
                a = ((ca[cname].get("slo") or {}).get(prof) or {}).get("goodput_rps")
                crow[f"goodput.{prof}"] = {"baseline": v.get("goodput_rps"), "arm": a,
                                           "ratio": _ratio(a, v.get("goodput_rps"))}
            classes[cname] = crow
        out[name] = {"figures": rows, "classes": classes}
    return out


# --- progress -------------------------------------------------------------------------------------------------

class _Progress:
    """Two rich bars on stderr (runs; requests of the current run) on a terminal; a line per run otherwise."""

    def __init__(self, enabled: bool, total: int, console: Any, quiet: bool) -> None:
        self.total = total
        self.console = console
        self.quiet = quiet
        self.progress = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[stats]}"),
                                 console=Console(stderr=True))
        self.runs = self.progress.add_task("runs", total=total, stats="")
        self.reqs = self.progress.add_task("requests", total=None, stats="")

    def __enter__(self) -> _Progress:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.stop()

    def phase(self, slot: RunSlot, text: str, requests: int | None = None) -> None:
        if self.progress is None:
            return
        scale = "" if slot.main else f", time scale {slot.scale:g}"
        self.progress.update(self.runs, description=f"run {slot.position}/{self.total}: {slot.arm} "
                                                    f"(repeat {slot.repeat}{scale})", stats=text)
        if requests is not None:
            self.progress.reset(self.reqs, total=requests, completed=0, stats="")

    def tick(self, prog: Any, elapsed: float) -> None:
        if self.progress is None:
            return
        stats = f"sent {prog.sent}  done {prog.done}  errors {prog.errors}"
        if prog.recent_e2e:
            e = np.asarray(prog.recent_e2e[-1000:])
            stats += f"  E2E p50 {np.percentile(e, 50) * 1e3:.0f} ms p99 {np.percentile(e, 99) * 1e3:.0f} ms"
        self.progress.update(self.reqs, completed=prog.done, stats=stats)

    def finished(self, rec: dict) -> None:
        if self.progress is not None:
            self.progress.advance(self.runs)
        if self.quiet:
            return
        pc = rec["percentiles"]

        def ms(k: str, q: str) -> str:
            v = pc[k][q]
            return "n/a" if v is None else f"{v * 1e3:.1f}"

        scale = "" if rec["main"] else f" at time scale {rec['scale']:g}"
        line = (f"  run {rec['position']}/{self.total}: {rec['arm']} repeat {rec['repeat']}{scale}: "
                f"{rec['requests']['completed']}/{rec['requests']['measured']} completed in {rec['wall_s']:.1f} s, "
                f"TTFT P50/P99 {ms('ttft', 'p50')}/{ms('ttft', 'p99')} ms, E2E P50/P99 {ms('e2e', 'p50')}/"
                f"{ms('e2e', 'p99')} ms")
        (self.progress.console if self.progress is not None else self.console).print(line, highlight=False)


# --- the run --------------------------------------------------------------------------------------------------

@dataclass
class _Context:
    cfg: Any
    workload: Any
    tokenizer: Any
    out: Path
    health_timeout: float
    health_path: str | None
    stop_grace: float
    admin_key: str | None
    progress: _Progress
    live: list[ArmProcess]
    models: dict[str, str] = field(default_factory=dict)


def _auth(cfg: Any, arm: Arm) -> tuple[dict[str, str], str | None, dict[str, str]]:
    """(headers of the arm's requests, its key, the headers for its health and metrics checks)."""
    headers = {**cfg.headers, **arm.headers}
    key = arm.api_key or cfg.api_key
    check = dict(headers)
    if key:
        check["Authorization"] = f"Bearer {key}"
    return headers, key, check


async def _check_url_arm(arm: Arm, check_headers: dict[str, str], path: str | None, timeout: float) -> None:
    import httpx

    assert arm.url is not None
    deadline = time.monotonic() + timeout
    paths = (path,) if path else HEALTH_PATHS
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
        while True:
            ok, seen = await _healthy(client, arm.url, paths, check_headers)
            if ok:
                return
            if time.monotonic() > deadline:
                raise ArmError(f"arm {arm.name!r}: {redact_url(arm.url)} is unreachable or not healthy (GET "
                               f"{', '.join(paths)}: {seen})")
            await asyncio.sleep(0.25)


async def _discover_model(base: str, headers: dict[str, str]) -> str | None:
    import httpx

    try:
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
            r = await client.get(base + "/v1/models", headers=headers)
        data = r.json().get("data") or []
        if r.status_code == 200 and data and data[0].get("id"):
            return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return None


def _run_dir(out: Path, slot: RunSlot) -> Path:
    d = out / "arms" / slot.arm
    if not slot.main:
        d = d / f"scale-{slot.scale:g}"
    return d / f"repeat-{slot.repeat}"


async def _one_run(ctx: _Context, slot: RunSlot, arm: Arm, plan: Any) -> tuple[dict, dict, list]:
    """One run of the schedule against one arm: start it (a command), run the load, stop it."""
    import httpx

    from tailguard.bench.results import write_csv, write_json
    from tailguard.bench.runner import execute

    cfg = ctx.cfg
    run_dir = _run_dir(ctx.out, slot)
    run_dir.mkdir(parents=True, exist_ok=True)
    headers, key, check = _auth(cfg, arm)
    proc: ArmProcess | None = None
    process: dict[str, Any] | None = None
    n_planned = _planned_requests(plan)
    try:
        if arm.command is not None:
            proc = ArmProcess(arm, run_dir / "server.log")
            ctx.live.append(proc)
            ctx.progress.phase(slot, f"starting on port {proc.port}")
            proc.start()
            await proc.wait_healthy(ctx.health_timeout, ctx.health_path, check)
            url = proc.url
        else:
            assert arm.url is not None
            url = arm.url
        model = arm.model or cfg.model or ctx.models.get(arm.name) or await _discover_model(url, check)
        if not model:
            raise ArmError(f"arm {arm.name!r}: --model not given and {redact_url(url)}/v1/models lists no model: "
                           f"pass --model or --arm-model {arm.name}=MODEL")
        if arm.kind == "url":
            ctx.models[arm.name] = model
        c = dataclasses.replace(cfg, url=url, model=model, api_key=key, headers=headers, label=arm.name,
                                output_dir=None, progress=False)
        recorder = _Recorder(ctx.workload)
        ctx.progress.phase(slot, "load", requests=n_planned)
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            before, _ = await scrape_replica_seconds(client, url, check, ctx.admin_key)
            t0 = time.monotonic()
            after: dict[str, Any] = {}

            async def after_load() -> None:
                after["t"] = time.monotonic()  # the load's end: the cost window closes here, before the analysis
                if before is not None:
                    after["value"], after["source"] = await scrape_replica_seconds(client, url, check, ctx.admin_key)

            try:
                res, ms = await execute(c, workload=recorder, tokenizer=ctx.tokenizer, plan=dataclasses.replace(plan),
                                        display=False, on_tick=ctx.progress.tick, after_load=after_load)
            except ConnectionError as exc:
                raise ArmError(f"arm {arm.name!r}: {exc}") from None
    finally:
        if proc is not None:
            ctx.progress.phase(slot, "stopping")
            process = proc.stop(ctx.stop_grace)
            ctx.live.remove(proc)
    wall = after.get("t", time.monotonic()) - t0
    value = after.get("value")
    if before is not None and value is not None and value >= before:
        cost = {"replica_seconds": value - before, "source": f"gateway {after.get('source')}",
                "gateway_before": before, "gateway_after": value}
    else:
        cost = {"replica_seconds": arm.replicas * wall, "source": "declared replicas x wall time"}
    cost.update(wall_s=wall, replicas_declared=arm.replicas)
    write_json(run_dir / "results.json", res)
    write_csv(run_dir / "requests.csv", ms)
    classes = Counter(m.traffic_class for m in ms if m.traffic_class)
    rec: dict[str, Any] = {
        "position": slot.position, "arm": arm.name, "repeat": slot.repeat, "scale": slot.scale, "main": slot.main,
        "run_id": res["run"]["id"], "started_at": res["run"]["started_at"], "url": redact_url(url), "model": model,
        "wall_s": wall, "duration_s": res["summary"]["duration_s"], "requests": res["summary"]["requests"],
        "error_rate": res["summary"]["error_rate"],
        "percentiles": {k: {q: _pv(res["metrics"], k, q) for q in FIGURE_PCTS} for k in FIGURE_METRICS},
        "slo": {n: (v["pass"] if v.get("evaluated") else None) for n, v in res["slo"].items()},
        "goodput_rps": {n: v.get("goodput_rps") for n, v in res["slo"].items()},
        "schedule": {"fingerprint": fingerprint(ms, recorder.seen, plan.offsets if plan.mode == "open" else None),
                     "requests": len(ms), "classes": dict(classes)},
        "cost": cost,
        "process": None if process is None else {**process, "log": str((run_dir / "server.log")
                                                                       .relative_to(ctx.out))},
        "bench_is_bottleneck": bool((res.get("bench_health") or {}).get("bench_is_bottleneck")),
        "warnings": res.get("warnings") or [],
        "results": str((run_dir / "results.json").relative_to(ctx.out)),
        "requests_csv": str((run_dir / "requests.csv").relative_to(ctx.out)),
    }
    return rec, res, ms


def _cost(arm: Arm, recs: Sequence[dict], completed: int) -> dict:
    """An arm's replica-seconds over its main runs, in all and per 1,000 completed requests."""
    rs = sum(r["cost"]["replica_seconds"] for r in recs)
    sources = sorted({r["cost"]["source"] for r in recs})
    gateway = bool(sources) and all(x.startswith("gateway") for x in sources)
    return {"replica_seconds": rs, "wall_s": sum(r["cost"]["wall_s"] for r in recs),
            "replicas_declared": arm.replicas, "sources": sources,
            "per_1000_requests": rs / completed * 1000 if completed else None,
            "note": "replica-seconds of the main time scale's runs: " + (
                "read from the gateway's own counter" if gateway else
                "the declared replicas times each run's wall time (load and stage join)")}


def _capacity(by_scale: dict[float, tuple[int, dict]], main_scale: float, plans: dict[float, Any],
              profile: str | None) -> dict:
    """The highest time scale (and its offered rate) at which an arm's pooled runs meet the SLO."""
    rows = []
    for scale, (n, ps) in sorted(by_scale.items()):
        v = verdict(ps, profile)
        rows.append({"scale": scale, "main": scale == main_scale, "runs": n, "offered_rps": _offered(plans[scale]),
                     "pass": v["pass"], "failed": v["failed"], "ttft_p99_s": _pv(ps["metrics"], "ttft", "p99"),
                     "e2e_p99_s": _pv(ps["metrics"], "e2e", "p99"),
                     "goodput_rps": {k: x.get("goodput_rps") for k, x in ps["slo"].items()},
                     "error_rate": ps["summary"]["error_rate"]})
    swept = len(rows) > 1
    passing = [r for r in rows if r["pass"]]
    best = max(passing, key=lambda r: r["scale"]) if passing and swept else None
    judged_by = f"the {profile} profile" if profile else "every judged profile and traffic class"
    if not swept:
        note = "not swept (give --sweep-scales, e.g. 1,2,4, for the highest time scale that meets the SLO)"
    elif best is None:
        note = f"failed {judged_by} at every time scale tried"
    else:
        note = f"the highest time scale tried at which the arm met {judged_by}"
    return {"swept": swept, "scales": rows, "profile": profile, "judged_by": judged_by,
            "best_scale": best["scale"] if best else None,
            "best_offered_rps": best["offered_rps"] if best else None, "note": note}


def _run_warnings(recs: Sequence[dict]) -> list[str]:
    out = []
    for r in recs:
        where = f"run {r['position']} ({r['arm']}, repeat {r['repeat']}" + (
            "" if r["main"] else f", time scale {r['scale']:g}") + ")"
        if r["bench_is_bottleneck"]:
            out.append(f"{where}: the bench may have distorted the latencies it measured (see that run's bench "
                       "health)")
        if r["requests"]["failed"]:
            out.append(f"{where}: {r['requests']['failed']} of {r['requests']['measured']} requests failed (each an "
                       "SLO miss)")
    return out


def _check_schedule(records: Sequence[dict], plans: dict[float, Any], closed: bool) -> tuple[dict, list[str]]:
    """Whether every run of each time scale sent the identical schedule (one fingerprint), and warnings if not."""
    schedule: dict[str, Any] = {"identical": True, "by_scale": {}}
    warnings = []
    for scale in sorted(plans):
        recs = [r for r in records if r["scale"] == scale]
        fps = sorted({r["schedule"]["fingerprint"] for r in recs})
        counts = sorted({r["schedule"]["requests"] for r in recs})
        same = len(fps) == 1
        schedule["by_scale"][f"{scale:g}"] = {"fingerprints": fps, "requests": counts, "identical": same,
                                              "offered_rps": _offered(plans[scale]),
                                              "planned_requests": _planned_requests(plans[scale])}
        if not same:
            schedule["identical"] = False
            warnings.append(f"the runs at time scale {scale:g} did not all send the identical schedule (fingerprints "
                            f"{', '.join(fps)}; requests {', '.join(map(str, counts))}): compare them with care")
    if closed:
        warnings.append("closed loop: each arm's requests follow its own answers, so the arms share prompts and their "
                        "order but not arrival times; for the identical schedule use --rate or --trace")
    schedule["note"] = ("each run's fingerprint digests every request it sent: its index, intended send offset, "
                        "prompt, max_tokens and traffic class")
    return schedule, warnings


def _gate(rules: Any, names: Sequence[str], pooled: dict[str, dict], cfg: Any) -> dict:
    """Every arm against the first, by the rules of ``bench compare --gate``, on their pooled requests."""
    from tailguard.bench.compare import compare

    gate: dict[str, Any] = {"pass": True, "baseline": names[0], "by_arm": {}}
    for name in names[1:]:
        cmp = compare(pooled[names[0]], pooled[name], rules, reps=cfg.bootstrap, seed=cfg.seed)
        gate["rules"] = cmp["rules"]
        gate["by_arm"][name] = {"pass": cmp["gate"]["pass"], "rows": cmp["rows"],
                                "reasons": [r.replace("B fails", f"{name} fails") for r in cmp["gate"]["reasons"]],
                                "failed_classes": cmp["gate"].get("failed_classes", [])}
        gate["pass"] = gate["pass"] and cmp["gate"]["pass"]
    return gate


def default_output_dir() -> Path:
    return Path("runs") / ("ab-" + time.strftime("%Y%m%d-%H%M%S"))


async def run_ab(cfg: Any, arms: Sequence[Arm], slots: Sequence[RunSlot], out: Path, *, rules: Any = None,
                 sweep_profile: str | None = None, health_timeout: float = 120.0, health_path: str | None = None,
                 stop_grace: float = 10.0, pause: float = 0.0, admin_key_env: str | None = "TAILGUARD_ADMIN_KEY",
                 quiet: bool = False, console: Any = None, live: list[ArmProcess] | None = None,
                 tokenizer: Any = None, order: str = "abba") -> tuple[dict, dict[str, Path]]:
    """Every run of ``slots``, then the pooled analysis; writes results.json and report.html in ``out``."""
    from tailguard import __version__
    from tailguard.bench.ab_report import write_ab_report
    from tailguard.bench.profiles import load_profiles
    from tailguard.bench.results import write_json
    from tailguard.bench.runner import build_plan, build_workload, run_secrets
    from tailguard.bench.tokens import load_tokenizer
    from tailguard.bench.workloads import TraceWorkload

    if console is None:
        from rich.console import Console

        console = Console(highlight=False)
    live = live if live is not None else []
    run_id = "tga-" + secrets.token_hex(4)
    started = datetime.now(UTC)
    tokenizer = tokenizer or load_tokenizer(cfg.tokenizer)
    workload = build_workload(cfg, tokenizer)  # once: every run of every arm replays this one
    main_plan = build_plan(cfg, workload)
    main_scale = next(s.scale for s in slots if s.main)
    plans: dict[float, Any] = {main_scale: main_plan}
    for s in slots:
        if s.scale not in plans:
            if main_plan.mode != "open" or main_plan.offsets is None:
                raise ValueError("--sweep-scales scales an open-loop schedule in time: use it with --trace or --rate")
            # the same arrivals, every gap divided by the scale (relative to the main one)
            plans[s.scale] = dataclasses.replace(main_plan, offsets=np.asarray(main_plan.offsets) * (main_scale /
                                                                                                     s.scale))
    admin_key = os.environ.get(admin_key_env) if admin_key_env else None
    hidden = set(run_secrets(cfg))
    for a in arms:
        hidden.update(a.secrets())
    if admin_key and len(admin_key) >= 4:
        hidden.add(admin_key)
    hidden_list = sorted(hidden, key=len, reverse=True)
    profiles = load_profiles(list(cfg.profiles))
    for arm in arms:  # a URL arm must answer before anything runs
        if arm.kind == "url":
            await _check_url_arm(arm, _auth(cfg, arm)[2], health_path, min(URL_CHECK_S, health_timeout))
    out.mkdir(parents=True, exist_ok=True)
    progress = _Progress(not quiet and sys.stderr.isatty(), len(slots), console, quiet)
    ctx = _Context(cfg, workload, tokenizer, out, health_timeout, health_path, stop_grace, admin_key, progress, live)
    by_name = {a.name: a for a in arms}
    records: list[dict] = []
    runs: dict[tuple[str, float], list[tuple[dict, list]]] = {}
    if not quiet:
        sequence = " ".join(s.arm for s in slots if s.main)
        console.print(f"A/B run {run_id}: {len(arms)} arms, {len(slots)} runs; order {sequence}", highlight=False)
    with progress:
        for slot in slots:
            if pause and slot.position > 1:
                await asyncio.sleep(pause)
            rec, res, ms = await _one_run(ctx, slot, by_name[slot.arm], plans[slot.scale])
            records.append(rec)
            runs.setdefault((slot.arm, slot.scale), []).append((res, ms))
            progress.finished(rec)

    class_defs = list(workload.classes) if hasattr(workload, "classes") else None
    by_column = bool(class_defs and getattr(workload, "by_column", False))
    arms_out: dict[str, dict] = {}
    pooled_files: dict[str, dict] = {}
    warnings: list[str] = []
    for arm in arms:
        main_runs = runs[(arm.name, main_scale)]
        pooled, samp = pool(main_runs, cfg, profiles, class_defs, by_column, cfg.class_column)
        mine = [r for r in records if r["arm"] == arm.name]
        main_recs = [r for r in mine if r["main"]]
        class_spread = {}
        for cname in ((pooled.get("classes") or {}).get("by_class") or {}):
            class_spread[cname] = spread([((r.get("classes") or {}).get("by_class") or {}).get(cname, {})
                                          .get("metrics") or {} for r, _ in main_runs])
        cost = _cost(arm, main_recs, pooled["summary"]["requests"]["completed"])
        by_scale = {}
        for scale in sorted({s.scale for s in slots}):
            sr = runs[(arm.name, scale)]
            by_scale[scale] = (len(sr), pooled if scale == main_scale else
                               pool(sr, cfg, profiles, class_defs, by_column, cfg.class_column)[0])
        capacity = _capacity(by_scale, main_scale, plans, sweep_profile)
        arms_out[arm.name] = {
            "target": arm.describe(),
            "model": main_recs[0]["model"] if main_recs else None,
            "repeats": main_recs,
            "other_scales": [r for r in mine if not r["main"]],
            "pooled": pooled,
            "spread": spread([r["metrics"] for r, _ in main_runs]),
            "class_spread": class_spread,
            "verdict": verdict(pooled),
            "cost": cost,
            "capacity": capacity,
            "pooled_results": str((out / "arms" / arm.name / "pooled.json").relative_to(out)),
        }
        pooled_files[arm.name] = {
            "schema": "tailguard.bench/v1",
            "tool": {"name": "tailguard bench ab", "version": __version__},
            "run": {"id": f"{run_id}-{arm.name}", "label": arm.name,
                    "started_at": main_recs[0]["started_at"] if main_recs else None,
                    "target": {"url": main_recs[0]["url"] if main_recs else None,
                               "model": main_recs[0]["model"] if main_recs else None},
                    "note": f"the {len(main_runs)} runs of arm {arm.name} of A/B run {run_id}, pooled"},
            **{k: pooled[k] for k in ("summary", "metrics", "slo", "stages", "tokens") if k in pooled},
            **({"classes": pooled["classes"]} if pooled.get("classes") else {}),
            "samples": samp,
        }
        warnings += _run_warnings(mine)
    baseline = arms[0].name
    schedule, more = _check_schedule(records, plans, closed=main_plan.mode == "closed")
    warnings += more
    gate = _gate(rules, [a.name for a in arms], pooled_files, cfg) if rules is not None else None
    load = main_plan.describe()
    load.update(time_scale=main_scale, offered_rps=_offered(main_plan), window=cfg.trace_window,
                planned_requests=_planned_requests(main_plan))
    if main_plan.mode == "open":
        load["arrival"] = "trace" if isinstance(getattr(workload, "base", workload), TraceWorkload) else cfg.arrival
        load["rate"] = cfg.rate
    wl = workload.describe()
    if isinstance(getattr(workload, "base", workload), TraceWorkload):
        wl["attribution"] = "Azure LLM inference trace 2023, CC-BY 4.0, Patel et al., Splitwise (ISCA 2024)"
    results: dict[str, Any] = {
        "schema": SCHEMA,
        "tool": {"name": "tailguard bench ab", "version": __version__},
        "run": {
            "id": run_id, "label": cfg.label, "started_at": started.isoformat(),
            "finished_at": datetime.now(UTC).isoformat(), "command": command_line(sys.argv), "seed": cfg.seed,
            "workload": wl, "load": load, "order_pattern": order,
            "repeats": max((s.repeat for s in slots if s.main), default=0),
            "scales": sorted({s.scale for s in slots}), "main_scale": main_scale,
            "profiles": [p.name for p in profiles], "sweep_profile": sweep_profile,
            "options": {"health_timeout_s": health_timeout, "health_path": health_path, "stop_grace_s": stop_grace,
                        "pause_s": pause, "bootstrap": cfg.bootstrap, "endpoint": cfg.path(), "stream": cfg.stream,
                        "join": cfg.join, "failures_as_timeout": cfg.failures_as_timeout},
        },
        "baseline": baseline,
        "order": [{"position": s.position, "arm": s.arm, "repeat": s.repeat, "scale": s.scale, "main": s.main}
                  for s in slots],
        "schedule": schedule,
        "arms": arms_out,
        "ratios": ratios(arms_out, baseline),
        "gate": gate,
        "warnings": warnings,
    }
    results = scrub(results, hidden_list)
    paths = {"json": out / "results.json", "html": out / "report.html"}
    for name, doc in pooled_files.items():
        write_json(out / "arms" / name / "pooled.json", scrub(doc, hidden_list))
    write_json(paths["json"], results)
    write_ab_report(results, paths["html"])
    return results, paths


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_ab_sync(cfg: Any, arms: Sequence[Arm], slots: Sequence[RunSlot], out: Path,
                **kw: Any) -> tuple[dict, dict[str, Path]]:
    """``run_ab`` on a fresh event loop (uvloop when present). Whatever happens (an error, Ctrl-C, SIGTERM), every
    server this run started is stopped before it returns."""
    live: list[ArmProcess] = []
    grace = float(kw.get("stop_grace", 10.0))
    main_thread = threading.current_thread() is threading.main_thread()
    old = signal.getsignal(signal.SIGTERM) if main_thread else None
    if main_thread:
        signal.signal(signal.SIGTERM, _interrupt)  # stopped like Ctrl-C: the finally below stops the servers
    try:
        run: Callable[..., Any]
        try:
            import uvloop

            run = uvloop.run
        except ImportError:  # pragma: no cover
            run = asyncio.run
        return run(run_ab(cfg, arms, slots, out, live=live, **kw))
    finally:
        for p in list(live):
            p.stop(grace)
        if main_thread:
            signal.signal(signal.SIGTERM, old)
