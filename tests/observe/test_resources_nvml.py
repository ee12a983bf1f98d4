"""GPU sampling through NVML (``pip install tailguard[gpu]``), without a GPU: a fake ``pynvml`` with two devices whose
figures change between samples, one of which cannot say its utilisation (as a MIG slice cannot). The sampler reads
them every interval, windows them per GPU and sets the gauges; without NVML (no module, no driver) nothing of it
appears."""

from __future__ import annotations

import sys
import time
import types

import pytest
from prometheus_client import CollectorRegistry

from tailguard.observe.resources import Nvml, ResourceSampler


class NVMLError(Exception):
    pass


def fake_pynvml(devices: list[dict], fail_init: bool = False) -> types.ModuleType:
    """pynvml's functions that the sampler calls, over ``devices``: dicts of util (%), used (bytes), sm (MHz) that
    the test may change; a key set to None raises NVMLError as the real module does for an unsupported query."""
    nv = types.ModuleType("pynvml")
    nv.NVML_CLOCK_SM = 1
    nv.NVMLError = NVMLError
    nv.calls = {"init": 0, "shutdown": 0}

    def init() -> None:
        if fail_init:
            raise NVMLError("NVML Shared Library Not Found")
        nv.calls["init"] += 1

    def figure(h: int, key: str):
        v = devices[h][key]
        if v is None:
            raise NVMLError("Not Supported")
        return v

    def clock(h: int, kind: int) -> int:
        assert kind == nv.NVML_CLOCK_SM
        return figure(h, "sm")

    nv.nvmlInit = init
    nv.nvmlShutdown = lambda: nv.calls.__setitem__("shutdown", nv.calls["shutdown"] + 1)
    nv.nvmlDeviceGetCount = lambda: len(devices)
    nv.nvmlDeviceGetHandleByIndex = lambda i: i
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=figure(h, "util"), memory=0)
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=figure(h, "used"), total=80 << 30,
                                                                 free=(80 << 30) - figure(h, "used"))
    nv.nvmlDeviceGetClockInfo = clock
    return nv


def test_gpu_utilisation_memory_and_sm_clock_reach_the_gauges():
    devices = [{"util": 40, "used": 10 << 30, "sm": 1980}, {"util": None, "used": 2 << 30, "sm": 1410}]
    nv = fake_pynvml(devices)
    reg = CollectorRegistry()
    s = ResourceSampler(reg, "m", interval_s=0.05, window_s=5.0, cuda=False, nvml=nv)
    assert nv.calls["init"] == 1 and len(s.nvml.handles) == 2
    first = s.sample()
    assert [(g.index, g.util, g.mem_used, g.sm_clock_hz) for g in first.gpus] == [
        (0, 0.4, 10 << 30, 1.98e9), (1, None, 2 << 30, 1.41e9)]
    assert first.gpu_util == 0.4 and first.gpu_mem == 12 << 30  # the machine's GPUs together
    devices[0].update(util=90, used=12 << 30, sm=1200)  # busier, more memory, throttled
    s.sample()
    st = s.export()
    g0, g1 = st["gpus"]
    assert g0 == {"gpu": 0, "util_mean": 0.65, "util_max": 0.9, "mem_used_bytes_max": 12 << 30,
                  "mem_used_bytes_last": 12 << 30, "sm_clock_hz_mean": 1.59e9, "sm_clock_hz_min": 1.2e9}
    assert "util_mean" not in g1 and g1["sm_clock_hz_min"] == 1.41e9

    def value(name: str, gpu: str, stat: str) -> float | None:
        return reg.get_sample_value(name, {"model": "m", "gpu": gpu, "stat": stat})

    assert value("tailguard_gpu_utilization_ratio", "0", "mean") == 0.65
    assert value("tailguard_gpu_utilization_ratio", "0", "max") == 0.9
    assert value("tailguard_gpu_utilization_ratio", "1", "mean") is None  # not said: not exported
    assert value("tailguard_gpu_memory_used_bytes", "1", "last") == 2 << 30
    assert value("tailguard_gpu_sm_clock_hertz", "0", "min") == 1.2e9
    assert value("tailguard_gpu_sm_clock_hertz", "1", "mean") == 1.41e9
    s.stop()
    assert nv.calls["shutdown"] == 1


def test_the_sampler_thread_reads_the_gpus_every_interval():
    devices = [{"util": 10, "used": 1 << 30, "sm": 1500}]
    nv = fake_pynvml(devices)
    s = ResourceSampler(CollectorRegistry(), "m", interval_s=0.05, window_s=5.0, cuda=False, nvml=nv)
    s.start()
    try:
        time.sleep(0.6)
        devices[0]["util"] = 70
        time.sleep(0.3)
    finally:
        s.stop()
    with_gpus = [x for x in s.samples if x.gpus]
    assert len(with_gpus) >= 8  # ~100 ms or better: 0.9 s at 50 ms, on a loaded machine
    assert {x.gpus[0].util for x in with_gpus} == {0.1, 0.7}


def test_without_nvml_there_is_no_gpu_sampling(monkeypatch):
    # No module (nvidia-ml-py not installed): the default.
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert Nvml.load() is None
    reg = CollectorRegistry()
    s = ResourceSampler(reg, "m", cuda=False)
    assert s.nvml is None and s.g_nv_util is None
    assert s.sample().gpus == () and "gpus" not in s.export()
    assert not any(m.name.startswith("tailguard_gpu_") for m in reg.collect())
    # The module without a driver or a GPU: nvmlInit fails, and that is no error.
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([], fail_init=True))
    assert Nvml.load() is None
    empty = fake_pynvml([])
    monkeypatch.setitem(sys.modules, "pynvml", empty)
    assert Nvml.load() is None and empty.calls["shutdown"] == 1  # a driver with no GPU: let go at once
    # Off on request, even with NVML there.
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([{"util": 1, "used": 1, "sm": 1}]))
    assert ResourceSampler(CollectorRegistry(), "m", cuda=False, nvml=False).nvml is None
    assert ResourceSampler(CollectorRegistry(), "m", cuda=False).nvml is not None  # found when installed
    with pytest.raises(NVMLError):  # a module handed in that fails is the caller's error, not hidden
        ResourceSampler(CollectorRegistry(), "m", cuda=False, nvml=fake_pynvml([], fail_init=True))
