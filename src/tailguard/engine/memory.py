"""Sizing the KV cache from a memory budget, as the field does (vLLM's gpu_memory_utilization, its CPU KV space).

A budget is bytes ("1.5GiB", "800MB", 2e9) or a share of the memory available now (0 < f < 1: free RAM on the CPU,
free VRAM on CUDA). Tokens are the derived figure: budget // bytes per token, rounded down to whole blocks.
"""

from __future__ import annotations

import re
from typing import Any

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def available_bytes(device: Any) -> int:
    """Memory available for new allocations now: free VRAM on CUDA, MemAvailable on Linux, else physical pages.
    ``device``: a torch device, or anything with a ``type`` ("cpu", "cuda")."""
    if device.type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def parse_budget(value: str | float | int, device: Any) -> int:
    """Bytes for a budget given as bytes with a unit, plain bytes, or a share (0..1) of available memory."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"KV cache memory {value!r}: give bytes (e.g. 1.5GiB, 800MB) or a share of free memory (0.2)")
        number, unit = float(m.group(1)), m.group(2).lower()
    if number <= 0:
        raise ValueError(f"KV cache memory must be positive, got {value!r}")
    if not unit and number < 1:
        return int(number * available_bytes(device))
    return int(number * _UNITS[unit])


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


# --- the process heap -------------------------------------------------------------------------------------------------
# glibc's malloc serves a request below its mmap threshold from an arena and keeps what is freed there for reuse; only
# the free space at an arena's top goes back to the OS. The threshold starts at 128 KiB but rises (up to 32 MiB) each
# time a mapped block is freed, so after the first large tensors come and go, every prefill step's activations, gathered
# K/V and dequantized weights (1-30 MB each) are carved from arenas, interleaved with blocks that live on, and the
# server's resident set grew by ~100 MiB of free-but-kept heap under 32 long conversations. A fixed threshold keeps
# every block of at least this size in its own mapping, returned to the OS when freed; smaller blocks (Python objects,
# a decode step's rows) stay in the arenas. Measured on the decode path: no change (its large buffers are the per-step
# logits, one mapping and a few hundred page faults against a step of tens of milliseconds).
HEAP_MMAP_THRESHOLD = 1 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _libc():
    import ctypes
    import ctypes.util
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def bound_heap_retention(mmap_threshold: int = HEAP_MMAP_THRESHOLD) -> bool:
    """Pin glibc's mmap threshold (and the trim threshold with it) so that large freed blocks go back to the OS at
    once. Returns False where the C library is not glibc (nothing is changed there)."""
    libc = _libc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
    # Free space above 2x the threshold at an arena's top goes back at free(), as with the dynamic default.
    return ok and libc.mallopt(_M_TRIM_THRESHOLD, 2 * mmap_threshold) == 1


def release_free_heap() -> None:
    """Give the heap's free pages back to the OS (after loading: the file's header and the weights' staging copies
    leave holes in the arenas that nothing else would return)."""
    import gc

    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
