"""How many threads compute a step, on which pool, and how long they poll before sleeping: read when the kernels load.

tailguard's C kernels (engine/kernels/tg_kernels.c) run their parallel loops on a pool of their own by default. Its
threads poll for a short while when they run out of work (``DEFAULT_SPIN_US``), then sleep on a futex, and sleep at
once when a decode step ends, so a server between steps leaves the cores to its HTTP front, its tokenizer and anything
else on the host. OpenMP's pool (libgomp) instead polls ~5 ms after every parallel region (300,000 pauses), and a
decode step opens ~120 regions: its threads never slept while a server ran (benchmarks/noisy_neighbour.py measures
both).

Settings, in order of precedence:

- threads: ``--threads`` (the engine sets it after loading), else ``OMP_NUM_THREADS`` (its first number), else the
  CPUs this process may really use: its affinity mask, capped by its cgroup's CPU quota (v2 ``cpu.max``, v1
  ``cpu.cfs_quota_us``), rounded down, so that the kernels never outrun a quota and get throttled mid-step;
- polling: ``TAILGUARD_SPIN_US`` (microseconds), else ``OMP_WAIT_POLICY`` (``passive``: sleep at once, ``active``:
  poll up to ``ACTIVE_SPIN_US``), else ``DEFAULT_SPIN_US``;
- pool: ``TAILGUARD_THREAD_POOL`` = ``tailguard`` (the default) or ``openmp`` (libgomp's pool and static split, with
  OpenMP's own defaults and environment: the behaviour before this pool existed).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

THREAD_POOL_ENV = "TAILGUARD_THREAD_POOL"
SPIN_ENV = "TAILGUARD_SPIN_US"
POOLS = ("tailguard", "openmp")
# Long enough to bridge the gaps between a step's parallel loops (norms, RoPE, short attention: tens of us); after a
# step's last loop the workers sleep at once (the engine's Python work comes next). Measured by
# benchmarks/noisy_neighbour.py (30, 100, 300 and 1000 us within noise of each other; 0 lost ~10% of decode speed).
DEFAULT_SPIN_US = 100
# OMP_WAIT_POLICY=active: poll this long (libgomp polls ~minutes; a bound keeps an idle server idle eventually).
ACTIVE_SPIN_US = 1_000_000

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class ThreadSettings:
    pool: str  # "tailguard" or "openmp"
    threads: int
    spin_us: int
    source: str  # where the thread count came from


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 ``cpu.max`` ("QUOTA PERIOD" or "max PERIOD") -> CPUs allowed, None for no limit."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    quota = int(parts[0])
    period = int(parts[1]) if len(parts) > 1 else 100_000
    return quota / period if quota > 0 and period > 0 else None


def parse_cfs(quota: str, period: str) -> float | None:
    """cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` -> CPUs allowed, None for no limit (quota -1)."""
    q, p = int(quota.strip()), int(period.strip())
    return q / p if q > 0 and p > 0 else None


def _ancestors(mount: Path, path: str) -> list[Path]:
    """The cgroup's directory under ``mount`` and each parent up to the mount: a quota set higher up binds too."""
    rel = Path(path.strip().lstrip("/"))
    dirs = [mount / rel]
    while rel != Path("."):
        rel = rel.parent
        dirs.append(mount / rel)
    return dirs


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, ValueError):
        return None


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The CPUs this process's cgroup quota allows (the tightest along its path, v2 or v1), None where none is set."""
    membership = _read(proc_cgroup)
    if membership is None:
        return None
    limits: list[float] = []
    for line in membership.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":  # v2: one unified hierarchy
            for d in _ancestors(root, path):
                text = _read(d / "cpu.max")
                limit = parse_cpu_max(text) if text is not None else None
                if limit is not None:
                    limits.append(limit)
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own mount
            for mount in {root / controllers, root / "cpu", root / "cpu,cpuacct"}:
                for d in _ancestors(mount, path):
                    quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
                    if quota is not None and period is not None:
                        limit = parse_cfs(quota, period)
                        if limit is not None:
                            limits.append(limit)
    return min(limits) if limits else None


def affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def available_cpus(affinity: int | None = None, quota: float | None = None) -> tuple[int, str]:
    """CPUs the kernels may keep busy, and why: the affinity mask, capped by the quota rounded down (at least 1).
    Rounded down because threads that together outrun a quota are all stopped until the period ends."""
    n = affinity if affinity is not None else affinity_cpus()
    if quota is not None and math.floor(quota) < n:
        return max(1, math.floor(quota)), f"cgroup CPU quota {quota:g}"
    return max(1, n), "CPU affinity"


def _omp_num_threads(env: Mapping[str, str]) -> int | None:
    value = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    try:
        n = int(value)
    except ValueError:
        return None
    return n if n > 0 else None


def spin_us(env: Mapping[str, str]) -> int:
    value = env.get(SPIN_ENV)
    if value is not None and value.strip():
        us = int(value)
        if us < 0:
            raise ValueError(f"{SPIN_ENV} must be >= 0 microseconds, not {value!r}")
        return us
    policy = env.get("OMP_WAIT_POLICY", "").strip().lower()
    if policy == "passive":
        return 0
    if policy == "active":
        return ACTIVE_SPIN_US
    return DEFAULT_SPIN_US


def resolve(env: Mapping[str, str] | None = None, affinity: int | None = None,
            quota: float | None = None, read_quota: bool = True) -> ThreadSettings:
    """The settings the kernels apply when they load (``env``: os.environ unless given; the quota read from the
    cgroup files unless given or ``read_quota`` is False)."""
    env = os.environ if env is None else env
    pool = env.get(THREAD_POOL_ENV, "tailguard").strip().lower() or "tailguard"
    if pool not in POOLS:
        raise ValueError(f"{THREAD_POOL_ENV} must be one of {', '.join(POOLS)}, not {pool!r}")
    explicit = _omp_num_threads(env)
    if explicit is not None:
        threads, source = explicit, "OMP_NUM_THREADS"
    else:
        if quota is None and read_quota:
            quota = cgroup_cpu_limit()
        threads, source = available_cpus(affinity, quota)
    return ThreadSettings(pool=pool, threads=threads, spin_us=spin_us(env), source=source)
