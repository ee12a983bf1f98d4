"""Machine sampling: the server process's CPU use and memory every 100 ms, and the accelerator's when CUDA is
present, aggregated per window (mean and peak) for ``/metrics`` and for each request's resource snapshot.

A thread samples (a busy event loop must not thin the samples out); reads are cheap: ``/proc/self/stat`` and
``/proc/self/statm`` on Linux (``os.times`` elsewhere), ``torch.cuda`` utilization and memory only when CUDA is in use.
With NVML (``pip install tailguard[gpu]``: nvidia-ml-py's ``pynvml``) and a GPU that answers, every GPU's utilisation,
memory used and SM clock are read in the same 100 ms samples, whatever the process runs (a gateway's machine too):
``tailguard_gpu_utilization_ratio``, ``tailguard_gpu_memory_used_bytes`` and ``tailguard_gpu_sm_clock_hertz`` per
``gpu``, and ``gpus`` in the window's figures.
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


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU at one sample, as NVML reads it; None where the device does not say (MIG, a driver without it)."""

    index: int
    util: float | None  # 0-1: the share of the last sample period in which a kernel ran
    mem_used: int | None  # bytes, all processes
    sm_clock_hz: float | None


@dataclass
class Sample:
    t: float
    cpu: float  # cores busy over the last interval (1.0 = one core fully)
    rss: int
    gpu_util: float | None = None  # 0-1
    gpu_mem: int | None = None
    gpus: tuple[GpuSample, ...] = ()  # NVML's, per GPU


class Nvml:
    """The GPUs through NVML: a module with pynvml's functions (nvidia-ml-py, ``pip install tailguard[gpu]``)."""

    def __init__(self, module: Any) -> None:
        self.nv = module
        module.nvmlInit()
        self.handles = [module.nvmlDeviceGetHandleByIndex(i) for i in range(module.nvmlDeviceGetCount())]

    @classmethod
    def load(cls) -> Nvml | None:
        """NVML when pynvml is installed and a GPU answers, else None (no driver, no GPU: the common case)."""
        try:
            import pynvml
        except ImportError:
            return None
        try:
            nvml = cls(pynvml)
        except Exception:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...: no GPU to read
            return None
        if not nvml.handles:
            nvml.close()
            return None
        return nvml

    def read(self) -> tuple[GpuSample, ...]:
        nv = self.nv
        out = []
        for i, h in enumerate(self.handles):
            util = mem = clock = None
            with contextlib.suppress(Exception):  # NVMLError_NotSupported on some devices: that figure only
                util = nv.nvmlDeviceGetUtilizationRates(h).gpu / 100
            with contextlib.suppress(Exception):
                mem = int(nv.nvmlDeviceGetMemoryInfo(h).used)
            with contextlib.suppress(Exception):
                clock = nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM) * 1e6  # MHz
            out.append(GpuSample(i, util, mem, clock))
        return tuple(out)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.nv.nvmlShutdown()


class ResourceSampler:
    def __init__(self, registry: CollectorRegistry, model: str, interval_s: float = 0.1, window_s: float = 10.0,
                 cuda: bool | None = None, nvml: Any = None) -> None:
        """``nvml``: None, NVML when pynvml is installed and a GPU answers; False, never; a module with pynvml's
        functions, that one (a test's fake)."""
        self.interval = interval_s
        self.window = window_s
        self.samples: deque[Sample] = deque(maxlen=max(2, int(window_s / interval_s) + 1))
        self.cuda = self._cuda_available() if cuda is None else cuda
        self.nvml = Nvml.load() if nvml is None else (Nvml(nvml) if nvml is not False else None)
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
        gpu = [*m, "gpu", "stat"]
        self.g_nv_util = Gauge("tailguard_gpu_utilization_ratio", "Each GPU's utilisation (NVML: the share of time "
                               "a kernel ran, 0-1), per window: mean and max.", gpu, registry=registry) \
            if self.nvml else None
        self.g_nv_mem = Gauge("tailguard_gpu_memory_used_bytes", "Each GPU's memory in use, all processes (NVML), "
                              "per window: max and last.", gpu, registry=registry) if self.nvml else None
        self.g_nv_clock = Gauge("tailguard_gpu_sm_clock_hertz", "Each GPU's SM clock (NVML), per window: mean and "
                                "min (a throttled GPU shows in the min).", gpu, registry=registry) \
            if self.nvml else None
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
        if self.nvml is not None:
            s.gpus = self.nvml.read()
            if not self.cuda:  # the machine's GPUs together, where torch does not say what this process uses
                utils = [g.util for g in s.gpus if g.util is not None]
                mems = [g.mem_used for g in s.gpus if g.mem_used is not None]
                s.gpu_util = sum(utils) / len(utils) if utils else None
                s.gpu_mem = sum(mems) if mems else None
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
        gpus = _per_gpu(xs)
        if gpus:
            out["gpus"] = gpus
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
            for g in st.get("gpus", ()):
                i = str(g["gpu"])
                for gauge, stat, key in ((self.g_nv_util, "mean", "util_mean"), (self.g_nv_util, "max", "util_max"),
                                         (self.g_nv_mem, "max", "mem_used_bytes_max"),
                                         (self.g_nv_mem, "last", "mem_used_bytes_last"),
                                         (self.g_nv_clock, "mean", "sm_clock_hz_mean"),
                                         (self.g_nv_clock, "min", "sm_clock_hz_min")):
                    if gauge is not None and g.get(key) is not None:
                        gauge.labels(m, i, stat).set(g[key])
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
        if self.nvml is not None and (self._thread is None or not self._thread.is_alive()):
            self.nvml.close()


def _per_gpu(xs: list[Sample]) -> list[dict[str, Any]]:
    """Each GPU's figures over the window's samples: utilisation mean and max, memory max and last, SM clock mean
    and min."""
    by_gpu: dict[int, list[GpuSample]] = {}
    for s in xs:
        for g in s.gpus:
            by_gpu.setdefault(g.index, []).append(g)
    out = []
    for i, gs in sorted(by_gpu.items()):
        row: dict[str, Any] = {"gpu": i}
        utils = [g.util for g in gs if g.util is not None]
        if utils:
            row["util_mean"], row["util_max"] = round(sum(utils) / len(utils), 3), round(max(utils), 3)
        mems = [g.mem_used for g in gs if g.mem_used is not None]
        if mems:
            row["mem_used_bytes_max"], row["mem_used_bytes_last"] = max(mems), mems[-1]
        clocks = [g.sm_clock_hz for g in gs if g.sm_clock_hz is not None]
        if clocks:
            row["sm_clock_hz_mean"], row["sm_clock_hz_min"] = round(sum(clocks) / len(clocks)), min(clocks)
        out.append(row)
    return out
