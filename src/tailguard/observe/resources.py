"""Machine sampling: the server process's CPU use and memory every 100 ms, and the accelerator's when CUDA is
present, aggregated per window (mean and peak) for ``/metrics`` and for each request's resource snapshot.

A thread samples (a busy event loop must not thin the samples out); reads are cheap: ``/proc/self/stat`` and
``/proc/self/statm`` on Linux (``os.times`` elsewhere), ``torch.cuda`` utilization and memory only when CUDA is in use.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


@dataclass
class Sample:
    t: float
    cpu: float  # cores busy over the last interval (1.0 = one core fully)
    rss: int
    gpu_util: float | None = None  # 0-1
    gpu_mem: int | None = None


class ResourceSampler:
    def __init__(self, registry: CollectorRegistry, model: str, interval_s: float = 0.1, window_s: float = 10.0,
                 cuda: bool | None = None) -> None:
        self.interval = interval_s
        self.window = window_s
        self.samples: deque[Sample] = deque(maxlen=max(2, int(window_s / interval_s) + 1))
        self.cuda = self._cuda_available() if cuda is None else cuda
        m = ["model"]
        self.model = model
        self.g_cpu = Gauge("tailguard_process_cpu_cores", "Server process CPU use in cores, per window.",
                           [*m, "stat"], registry=registry)
        self.g_rss = Gauge("tailguard_process_resident_memory_bytes_window", "Server process RSS, per window.",
                           [*m, "stat"], registry=registry)
        self.g_gpu = Gauge("tailguard_accelerator_utilization_ratio", "Accelerator utilization (0-1), per window.",
                           [*m, "stat"], registry=registry) if self.cuda else None
        self.g_gpu_mem = Gauge("tailguard_accelerator_memory_bytes", "Accelerator memory in use, per window.",
                               [*m, "stat"], registry=registry) if self.cuda else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last = (time.perf_counter(), _cpu_seconds())

    @staticmethod
    def _cuda_available() -> bool:
        import sys

        torch = sys.modules.get("torch")  # only where the engine already loaded it: a gateway never imports torch
        return bool(torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized())

    def sample(self) -> Sample:
        now, cpu = time.perf_counter(), _cpu_seconds()
        t0, c0 = self._last
        self._last = (now, cpu)
        s = Sample(now, (cpu - c0) / (now - t0) if now > t0 else 0.0, _rss_bytes())
        if self.cuda:
            import torch

            try:
                s.gpu_util = torch.cuda.utilization() / 100
            except Exception:  # noqa: BLE001 - pynvml missing: memory only
                s.gpu_util = None
            s.gpu_mem = torch.cuda.memory_allocated()
        self.samples.append(s)
        return s

    def window_stats(self) -> dict[str, Any]:
        """Mean and peak over the window (what a request's resource snapshot and /metrics carry)."""
        now = time.perf_counter()
        # tuple() copies in one C call, so the sampler thread cannot append mid-copy (iterating the deque itself
        # raised "deque mutated during iteration" under load)
        xs = [s for s in tuple(self.samples) if s.t >= now - self.window]
        if not xs:
            return {}
        out: dict[str, Any] = {
            "cpu_cores_mean": round(sum(s.cpu for s in xs) / len(xs), 3),
            "cpu_cores_max": round(max(s.cpu for s in xs), 3),
            "rss_bytes_max": max(s.rss for s in xs), "rss_bytes_last": xs[-1].rss, "samples": len(xs),
        }
        gu = [s.gpu_util for s in xs if s.gpu_util is not None]
        if gu:
            out["gpu_util_mean"], out["gpu_util_max"] = round(sum(gu) / len(gu), 3), round(max(gu), 3)
        gm = [s.gpu_mem for s in xs if s.gpu_mem is not None]
        if gm:
            out["gpu_mem_bytes_max"] = max(gm)
        return out

    def export(self) -> dict[str, Any]:
        st = self.window_stats()
        if st:
            m = self.model
            self.g_cpu.labels(m, "mean").set(st["cpu_cores_mean"])
            self.g_cpu.labels(m, "max").set(st["cpu_cores_max"])
            self.g_rss.labels(m, "max").set(st["rss_bytes_max"])
            self.g_rss.labels(m, "last").set(st["rss_bytes_last"])
            if self.g_gpu is not None and "gpu_util_mean" in st:
                self.g_gpu.labels(m, "mean").set(st["gpu_util_mean"])
                self.g_gpu.labels(m, "max").set(st["gpu_util_max"])
            if self.g_gpu_mem is not None and "gpu_mem_bytes_max" in st:
                self.g_gpu_mem.labels(m, "max").set(st["gpu_mem_bytes_max"])
        return st

    def start(self) -> None:
        def run() -> None:
            while not self._stop.wait(self.interval):
                with contextlib.suppress(Exception):  # sampling must never stop the server
                    self.sample()

        self._thread = threading.Thread(target=run, name="tailguard-resources", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)
