"""Thread settings (engine/threads.py) and the kernels' own thread pool (tg_kernels.c, "threads").

The settings: the cgroup quota as v2 and v1 write it, the count a process may really use, the environment's
precedence. The pool: idle workers sleep (no CPU while a server waits), results do not depend on it, and it
survives concurrent callers, count changes and fork.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tailguard.engine import kernels, threads
from tailguard.engine.threads import (
    ACTIVE_SPIN_US,
    DEFAULT_SPIN_US,
    available_cpus,
    cgroup_cpu_limit,
    parse_cfs,
    parse_cpu_max,
    resolve,
)

# --- the cgroup quota -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, cpus", [("max 100000\n", None), ("150000 100000\n", 1.5), ("200000 50000", 4.0),
                                         ("max", None), ("", None)])
def test_cpu_max_is_quota_over_period(text, cpus):
    assert parse_cpu_max(text) == cpus


@pytest.mark.parametrize("quota, period, cpus", [("-1\n", "100000\n", None), ("50000", "100000", 0.5),
                                                 ("300000", "100000", 3.0)])
def test_cfs_quota_is_quota_over_period(quota, period, cpus):
    assert parse_cfs(quota, period) == cpus


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v2_limit_is_the_tightest_on_the_path_to_the_root(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "proc-cgroup"
    _write(proc, "0::/system.slice/app.service\n")
    _write(root / "cpu.max", "max 100000\n")
    _write(root / "system.slice/app.service/cpu.max", "250000 100000\n")
    assert cgroup_cpu_limit(root, proc) == 2.5
    _write(root / "system.slice/cpu.max", "150000 100000\n")  # a parent's quota binds its children
    assert cgroup_cpu_limit(root, proc) == 1.5


def test_v2_namespace_root_is_read_when_the_path_is_not_mounted(tmp_path):
    """In a container the cgroup file may name the host's path while /sys/fs/cgroup is the container's own cgroup."""
    root, proc = tmp_path / "cgroup", tmp_path / "proc-cgroup"
    _write(proc, "0::/kubepods/pod1/abc\n")
    _write(root / "cpu.max", "100000 100000\n")
    assert cgroup_cpu_limit(root, proc) == 1.0


def test_v1_quota_is_read_from_the_cpu_controller(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "proc-cgroup"
    _write(proc, "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    _write(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "150000\n")
    _write(root / "cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(root, proc) == 1.5


def test_no_quota_anywhere_is_none(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "proc-cgroup"
    _write(proc, "4:cpu,cpuacct:/\n0::/\n")
    _write(root / "cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    _write(root / "cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    _write(root / "cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(root, proc) is None
    assert cgroup_cpu_limit(root, tmp_path / "missing") is None


# --- the thread count and polling -----------------------------------------------------------------------------------


@pytest.mark.parametrize("affinity, quota, expected", [(8, None, 8), (8, 2.5, 2), (8, 0.5, 1), (2, 16.0, 2),
                                                        (4, 4.0, 4)])
def test_available_cpus_is_affinity_capped_by_the_quota_rounded_down(affinity, quota, expected):
    n, source = available_cpus(affinity, quota)
    assert n == expected
    assert source.startswith("cgroup CPU quota" if quota is not None and quota < affinity else "CPU affinity")


def test_the_default_is_every_usable_cpu_with_the_own_pool_polling_briefly():
    s = resolve({}, affinity=6, quota=None, read_quota=False)
    assert (s.pool, s.threads, s.spin_us, s.source) == ("tailguard", 6, DEFAULT_SPIN_US, "CPU affinity")
    assert resolve({}, affinity=6, quota=3.9).threads == 3


@pytest.mark.parametrize("value, expected", [("3", 3), ("4,2", 4), (" 5 ", 5)])
def test_omp_num_threads_wins_over_the_cpus(value, expected):
    s = resolve({"OMP_NUM_THREADS": value}, affinity=2, quota=1.0)
    assert (s.threads, s.source) == (expected, "OMP_NUM_THREADS")


@pytest.mark.parametrize("value", ["", "0", "many"])
def test_an_unusable_omp_num_threads_is_ignored(value):
    assert resolve({"OMP_NUM_THREADS": value}, affinity=2, read_quota=False).threads == 2


@pytest.mark.parametrize("env, spin", [({"OMP_WAIT_POLICY": "passive"}, 0), ({"OMP_WAIT_POLICY": "ACTIVE"},
                                                                           ACTIVE_SPIN_US),
                                       ({"TAILGUARD_SPIN_US": "40", "OMP_WAIT_POLICY": "passive"}, 40),
                                       ({"TAILGUARD_SPIN_US": "0"}, 0)])
def test_wait_policy_and_spin_time(env, spin):
    assert resolve(env, affinity=2, read_quota=False).spin_us == spin


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError, match="TAILGUARD_THREAD_POOL"):
        resolve({"TAILGUARD_THREAD_POOL": "tbb"}, affinity=2, read_quota=False)
    with pytest.raises(ValueError, match="TAILGUARD_SPIN_US"):
        resolve({"TAILGUARD_SPIN_US": "-5"}, affinity=2, read_quota=False)
    assert resolve({"TAILGUARD_THREAD_POOL": "OpenMP"}, affinity=2, read_quota=False).pool == "openmp"


def _fresh_process(env: dict[str, str], code: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in (
        "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", threads.THREAD_POOL_ENV, threads.SPIN_ENV)}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**clean, **env}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


pool_needed = pytest.mark.skipif(not kernels.available(), reason="the thread pool is tailguard's kernels' (gcc)")


@pool_needed
def test_the_library_applies_the_environment_when_it_loads():
    code = """
        from tailguard.engine import kernels
        s = kernels.thread_settings_loaded()
        print(s.pool, s.threads, s.spin_us, kernels.num_threads())
    """
    assert _fresh_process({"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "passive"}, code) == "tailguard 3 0 3"
    assert _fresh_process({"TAILGUARD_SPIN_US": "25"}, code).split()[2] == "25"
    # OpenMP's pool keeps OpenMP's own count (OMP_NUM_THREADS here)
    assert _fresh_process({"TAILGUARD_THREAD_POOL": "openmp", "OMP_NUM_THREADS": "3"}, code).split()[::3] == [
        "openmp", "3"]


@pool_needed
def test_the_engine_threads_setting_wins_over_the_environment(tiny_gguf):
    code = f"""
        from tailguard.engine import kernels
        from tailguard.engine.engine import EngineArgs, LLMEngine
        LLMEngine(EngineArgs(model={str(tiny_gguf)!r}, kv_cache_tokens=256, num_threads=1))
        print(kernels.thread_settings_loaded().threads, kernels.num_threads())
    """
    assert _fresh_process({"OMP_NUM_THREADS": "3"}, code) == "3 1"


# --- the pool -------------------------------------------------------------------------------------------------------


def _matrix(n: int = 512, k: int = 1024) -> kernels.PackedMatrix:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(n, kernels.row_bytes(kernels.Q8_0, k)), dtype=np.uint8)
    data.reshape(n, k // 32, 34)[:, :, 1] = 0x2C  # float16 scales of ~0.06, not NaN or infinity
    return kernels.PackedMatrix(data, kernels.Q8_0, n, k)


@pytest.fixture
def pool():
    """The own pool with 2 threads; the loaded settings put back afterwards."""
    settings = kernels.thread_settings_loaded()
    before = kernels.num_threads()
    kernels.set_thread_pool("tailguard")
    kernels.set_num_threads(2)
    try:
        yield kernels
    finally:
        kernels.set_thread_pool(settings.pool)
        kernels.set_spin_us(settings.spin_us)
        kernels.set_num_threads(before)


@pool_needed
def test_idle_workers_sleep_and_use_no_cpu(pool):
    w, x = _matrix(), np.ones((1, 1024), dtype=np.float32)
    pool.set_spin_us(2000)
    pool.linear(x, w)
    before = pool.thread_stats()
    for _ in range(20):
        pool.linear(x, w)
    assert pool.thread_stats()["workers"] == 1
    time.sleep(0.05)  # past the 2 ms of polling: the worker sleeps now
    cpu0 = time.process_time()
    time.sleep(0.3)
    assert time.process_time() - cpu0 < 0.05  # a polling worker would have burnt ~0.3 s
    # it went to sleep since the loops began: after its 2 ms of polling, or at once when a busy host had turned
    # polling off (the contention hold), in which case it was asleep already before the pause above
    assert pool.thread_stats()["worker_sleeps"] > before["worker_sleeps"]


@pool_needed
def test_no_polling_sleeps_between_loops_and_gives_the_same_numbers(pool):
    w = _matrix()
    x = np.random.default_rng(1).standard_normal((3, 1024)).astype(np.float32)
    pool.set_num_threads(1)
    ref = pool.linear(x, w)
    pool.set_num_threads(2)
    for spin in (0, 50, 100_000):
        pool.set_spin_us(spin)
        before = pool.thread_stats()
        got = [pool.linear(x, w) for _ in range(10)]
        assert all(np.array_equal(g, ref) for g in got)
        assert pool.thread_stats()["loops"] >= before["loops"] + 10
    pool.set_spin_us(0)
    before = pool.thread_stats()["worker_sleeps"]
    for _ in range(5):
        pool.linear(x, w)
        time.sleep(0.002)
    assert pool.thread_stats()["worker_sleeps"] >= before + 5  # no polling: a sleep after every loop


@pool_needed
def test_concurrent_callers_get_their_own_results(pool):
    """Two Python threads in the kernels at once (ctypes releases the GIL): one gets the pool, the other computes
    alone; neither sees the other's loop."""
    w = _matrix()
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((2, 1024)).astype(np.float32) for _ in range(2)]
    refs = [pool.linear(x, w) for x in xs]
    bad: list[int] = []

    def hammer(i: int) -> None:
        for _ in range(200):
            if not np.array_equal(pool.linear(xs[i], w), refs[i]):
                bad.append(i)

    workers = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(60)
    assert not any(t.is_alive() for t in workers) and bad == []


@pool_needed
@pytest.mark.parametrize(("threads", "spin_us", "work"), [(2, 0, 0), (2, 100, 0), (4, 100, 20), (3, 5, 0)])
def test_many_short_loops_neither_hang_nor_lose_a_chunk(threads, spin_us, work):
    """Hundreds of thousands of tiny loops, more threads than CPUs in some: the pool's hand-off between loops is where
    a race hides (one left a caller asleep forever within ~10,000 loops). A fresh process, so a hang is a timeout."""
    code = f"""
        from tailguard.engine import kernels
        kernels.set_num_threads({threads})
        kernels.set_spin_us({spin_us})
        print(kernels.pool_stress(200_000, 64, {work}), kernels.thread_stats()["loops"])
    """
    bad, loops = _fresh_process({}, code).split()
    assert bad == "0" and int(loops) > 150_000  # single-item loops run on the caller alone


@pool_needed
def test_two_callers_and_count_changes_under_stress(pool):
    """Two Python threads looping at once (one gets the pool, the other runs alone), with the thread count changing
    between rounds: every item runs once and every loop ends."""
    bad: list[int] = []
    for count in (2, 4, 3):
        pool.set_num_threads(count)
        callers = [threading.Thread(target=lambda w=w: bad.append(pool.pool_stress(20_000, 64, w))) for w in (0, 30)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(60)
        assert not any(t.is_alive() for t in callers)
    assert bad == [0] * 6
    with pytest.raises(ValueError):
        pool.pool_stress(10, 0)


@pool_needed
def test_count_changes_and_pool_switches_resize_the_workers(pool):
    w, x = _matrix(), np.ones((1, 1024), dtype=np.float32)
    for n in (3, 2):
        pool.set_num_threads(n)
        pool.linear(x, w)
        assert pool.num_threads() == n and pool.thread_stats()["workers"] == n - 1
    pool.set_thread_pool("openmp")
    assert pool.thread_stats()["workers"] == 0
    with pytest.raises(ValueError, match="thread pool"):
        pool.set_thread_pool("tbb")
    with pytest.raises(ValueError):
        pool.set_spin_us(-1)


@pool_needed
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_a_working_pool(pool):
    """The child of a fork has none of the parent's worker threads: its first loop must start new ones, not wait
    forever for the old ones."""
    w = _matrix()
    x = np.random.default_rng(3).standard_normal((2, 1024)).astype(np.float32)
    ref = pool.linear(x, w)
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only with the right numbers, killed by the alarm if it hangs
        signal.alarm(20)
        ok = np.array_equal(pool.linear(x, w), ref) and pool.thread_stats()["workers"] == 1
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pool_needed
def test_workers_sleep_as_soon_as_a_decode_step_ends(pool, tiny_gguf):
    """Even with a long polling time, the workers stop polling when a step ends: the engine's Python work comes
    next, and polling through it would only take the CPU from the server's other threads."""
    from tailguard.engine.engine import EngineArgs, LLMEngine
    from tailguard.engine.sequence import SamplingParams

    engine = LLMEngine(EngineArgs(model=str(tiny_gguf), kv_cache_tokens=512, num_threads=2))
    pool.set_spin_us(1_000_000)
    before = pool.thread_stats()
    engine.generate([list(range(100, 140))], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert pool.thread_stats()["loops"] > before["loops"]
    time.sleep(0.02)
    cpu0 = time.process_time()
    time.sleep(0.3)
    assert time.process_time() - cpu0 < 0.05  # a worker polling for its full second would have burnt ~0.3 s


@pool_needed
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity")
def test_polling_stops_when_the_pool_threads_get_preempted():
    """Two pool threads pinned to one CPU preempt each other: the pool sees its threads' involuntary context
    switches rise and stops polling (a poller would hold the CPU the other thread needs), and the numbers stay
    right."""
    code = """
        import os
        import time
        import numpy as np
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        from tailguard.engine import kernels
        data = np.random.default_rng(0).integers(0, 256, size=(512, 32 * 34), dtype=np.uint8)
        data.reshape(512, 32, 34)[:, :, 1] = 0x2C  # float16 scales of ~0.06
        w = kernels.PackedMatrix(data, kernels.Q8_0, 512, 1024)
        x = np.random.default_rng(4).standard_normal((2, 1024)).astype(np.float32)
        kernels.set_num_threads(1)
        ref = kernels.linear(x, w)
        kernels.set_num_threads(2)
        ok, t0 = True, time.monotonic()
        while time.monotonic() - t0 < 0.5 and kernels.thread_stats()["contention"] == 0:
            ok = ok and np.array_equal(kernels.linear(x, w), ref)
        print(ok, kernels.thread_stats()["contention"] > 0)
    """
    assert _fresh_process({"TAILGUARD_SPIN_US": "1000000"}, code) == "True True"
