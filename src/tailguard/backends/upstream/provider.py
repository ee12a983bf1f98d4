"""Replica providers: what starts and stops the gateway's replicas when the SLO monitor asks for more or fewer.

A provider (:class:`ReplicaProvider`) starts a replica and hands it to the pool once it is healthy, stops one after it
has drained, lists the replicas it runs, and counts what they cost in replica-seconds. :class:`ProcessProvider`
starts replica processes on this machine from a command template. :class:`ProviderScaler` is how the SLO monitor's
actions reach it: they run on the evaluation thread, one floor below, and are handed a scaler by the server instead of
importing this module. :class:`ReplicaLedger` counts replica-seconds for every replica of the pool (configured, added
through the admin API, or started here) and exports them to Prometheus, so that scale-out's cost is measured.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tailguard.backends.upstream.pool import Replica, UpstreamConfig, UpstreamPool
from tailguard.slo.config import ProcessProviderConfig

log = logging.getLogger("tailguard.gateway")

__all__ = ["HOST", "ProcessProvider", "ProvidedReplica", "ProviderScaler", "ReplicaLedger", "ReplicaProvider",
           "ReplicaStartError", "StopReport", "plan_scale"]

HOST = "127.0.0.1"  # provider replicas listen on loopback only: the gateway is their only client
Result = dict[str, Any]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def plan_scale(delta_pct: float, base: int, running: int, min_replicas: int, max_replicas: int,
               replicas: int | None = None) -> tuple[int, int, str | None]:
    """(replicas to start, > 0, or to stop, < 0; replicas the percentage asks for; why fewer, or None).

    ``base``: the replicas serving now (configured and started, not draining); ``running``: those the provider runs
    (draining ones included when scaling out). ``delta_pct`` of ``base``, rounded up, and at least one; or exactly
    ``replicas`` where given (the direction still from ``delta_pct``'s sign)."""
    wanted = replicas if replicas is not None else max(1, math.ceil(round(base * abs(delta_pct) / 100.0, 9)))
    if delta_pct > 0:
        n = min(wanted, max(0, max_replicas - running))
        why = f"max_replicas ({max_replicas}) reached" if n < wanted else None
        return n, wanted, why
    n = min(wanted, max(0, running - min_replicas))
    why = (f"min_replicas ({min_replicas}) kept" if min_replicas and n < wanted else
           "no replica started by the provider is left to stop" if n < wanted else None)
    return -n, wanted, why


class ReplicaStartError(RuntimeError):
    """A replica that did not become healthy: the message says why; its process has been stopped."""

    def __init__(self, message: str, replica: ProvidedReplica | None = None, output: str = "") -> None:
        super().__init__(message)
        self.replica = replica
        self.output = output


@dataclass(eq=False)
class ProvidedReplica:
    """One replica a provider started. Times are ``time.monotonic()``."""

    name: str
    url: str
    port: int
    state: str = "starting"  # starting -> serving -> draining -> stopped; or failed, or exited (on its own)
    pid: int | None = None
    spawned_at: float = field(default_factory=time.monotonic)
    serving_at: float | None = None
    ended_at: float | None = None
    log_path: str | None = None
    exit_status: int | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def alive_s(self, now: float | None = None) -> float:
        """Seconds from its start to its end (or to now): what it cost, start-up and drain included."""
        end = self.ended_at if self.ended_at is not None else (time.monotonic() if now is None else now)
        return max(0.0, end - self.spawned_at)

    @property
    def started_in_s(self) -> float | None:
        return None if self.serving_at is None else self.serving_at - self.spawned_at

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "state": self.state, "pid": self.pid,
                "started_in_s": _round(self.started_in_s), "alive_s": _round(self.alive_s()),
                "exit_status": self.exit_status, "log": self.log_path}


@dataclass(frozen=True)
class StopReport:
    """What stopping one replica took: the requests it finished while draining, those the drain timeout cut off."""

    name: str
    url: str
    drained: int
    left: int
    drain_s: float
    exit_status: int | None
    killed: bool  # SIGTERM was not enough: SIGKILL after the grace
    alive_s: float


class ReplicaProvider(Protocol):
    """What starts and stops replicas for the gateway's pool.

    ``start_replica`` returns once the replica is healthy and in the pool (taking traffic), or raises
    :class:`ReplicaStartError` with nothing of it left running; ``stop_replica`` drains one (the newest, unless
    named), takes it out of the pool and stops it; ``scale`` applies a percentage within the bounds and returns one
    result per step (the records the SLO monitor writes); ``replica_seconds`` is what its replicas have cost."""

    kind: str
    min_replicas: int
    max_replicas: int

    async def start_replica(self) -> ProvidedReplica: ...
    async def stop_replica(self, name: str | None = None) -> StopReport: ...
    async def scale(self, delta_pct: float, on_result: Callable[[Result], None] | None = None,
                    replicas: int | None = None) -> list[Result]: ...
    def replicas(self) -> list[ProvidedReplica]: ...
    def owns(self, url: str) -> bool: ...
    def replica_seconds(self) -> float: ...
    def summary(self) -> dict[str, Any]: ...
    def close_now(self) -> None: ...


# --- processes -------------------------------------------------------------------------------------------------------
def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to the replica's process group (it leads its own session), so that what a wrapper script started
    stops with it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _kill_all(procs: dict[int, subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every live replica process, SIGKILL what is left after ``grace_s``; reaps them all. Any thread; also
    run at interpreter exit, so that a gateway that ends without its shutdown leaves no replica behind."""
    live = [p for p in list(procs.values()) if p.poll() is None]
    for p in live:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for p in live) and time.monotonic() < deadline:
        time.sleep(0.02)
    for p in live:
        _signal_group(p, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(5)
    procs.clear()


def _tail(path: str | None, limit: int = 1500) -> str:
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


async def _answers_200(port: int, path: str, timeout_s: float = 1.0) -> bool:
    """One GET on the replica's health path over a fresh connection: 200 or not (refused, timed out, other)."""
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(HOST, port)
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
            status = await reader.readline()
    except (OSError, TimeoutError):
        return False
    finally:
        if writer is not None:
            writer.close()
    parts = status.split()
    return len(parts) >= 2 and parts[1] == b"200"


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


class ProcessProvider:
    """Replica processes on this machine, started from ``cfg.command`` with ``{port}`` (a free port on 127.0.0.1),
    ``{name}`` and ``{host}`` filled in. Each runs in a session of its own, its output in ``log_dir/<name>.log``.

    Runs on the gateway's event loop (``close_now`` excepted: any thread). Scale steps run one at a time; the replicas
    of one step start (or drain) together."""

    kind = "process"

    def __init__(self, cfg: ProcessProviderConfig, pool: UpstreamPool,
                 on_change: Callable[[], None] | None = None) -> None:
        self.cfg = cfg
        self.pool = pool
        self.on_change = on_change  # the replica set changed: the server's lanes follow its capacity
        self.min_replicas = cfg.min_replicas
        self.max_replicas = cfg.max_replicas
        self._live: list[ProvidedReplica] = []  # starting, serving, draining: oldest first
        self.ended: deque[ProvidedReplica] = deque(maxlen=20)  # the last ones stopped, failed or exited
        self.ended_s = 0.0  # replica-seconds of every replica that has ended
        self.started = 0
        self.failed = 0
        self._seq = 0
        self._step: asyncio.Lock | None = None
        self._log_dir: Path | None = Path(cfg.log_dir) if cfg.log_dir else None
        self._procs: dict[int, subprocess.Popen] = {}
        self._finalizer = weakref.finalize(self, _kill_all, self._procs, min(cfg.stop_grace_s, 5.0))
        self._keep_min: asyncio.Task | None = None
        self.closed = False

    # --- what it holds ----------------------------------------------------------------------------------------------
    def replicas(self) -> list[ProvidedReplica]:
        return list(self._live)

    def owns(self, url: str) -> bool:
        return any(r.url == url for r in self._live)

    def replica_seconds(self) -> float:
        now = time.monotonic()
        return self.ended_s + sum(r.alive_s(now) for r in self._live)

    def summary(self) -> dict[str, Any]:
        return {"kind": self.kind, "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "command": list(self.cfg.command), "started": self.started, "failed": self.failed,
                "replica_seconds": _round(self.replica_seconds()),
                "replicas": [r.describe() for r in self._live], "ended": [r.describe() for r in self.ended]}

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # noqa: BLE001 - the server's bookkeeping must not fail a scale step
                log.exception("replica provider: the change hook failed")

    def _end(self, rep: ProvidedReplica, state: str) -> None:
        if rep.ended_at is None:
            rep.ended_at = time.monotonic()
        rep.state = state
        if rep.proc is not None:
            rep.exit_status = rep.proc.poll()
            self._procs.pop(rep.proc.pid, None)
        if rep in self._live:
            self._live.remove(rep)
            self.ended_s += rep.alive_s()
            self.ended.append(rep)

    def _log_path(self, name: str) -> Path:
        if self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix="tailguard-replicas-"))
        self._log_dir.mkdir(parents=True, exist_ok=True)
        return self._log_dir / f"{name}.log"

    # --- start ------------------------------------------------------------------------------------------------------
    async def start_replica(self) -> ProvidedReplica:
        if self.closed:
            raise ReplicaStartError("the gateway is shutting down: no replica is started")
        if len(self._live) >= self.max_replicas:
            raise ReplicaStartError(f"max_replicas ({self.max_replicas}) reached: no replica is started")
        self._seq += 1
        name = f"{self.cfg.name_prefix}-{self._seq}"
        while any(r.name == name for r in self.pool.replicas):  # a configured replica of that name
            self._seq += 1
            name = f"{self.cfg.name_prefix}-{self._seq}"
        port = free_port()
        rep = ProvidedReplica(name, f"http://{HOST}:{port}", port)
        argv = [a.replace("{port}", str(port)).replace("{name}", name).replace("{host}", HOST)
                for a in self.cfg.command]
        log_path = self._log_path(name)
        rep.log_path = str(log_path)
        env = {**os.environ, **self.cfg.env} if self.cfg.env else None
        try:
            with open(log_path, "ab") as sink:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                                        start_new_session=True, env=env, cwd=self.cfg.cwd)
        except OSError as exc:
            self.failed += 1
            rep.ended_at = rep.spawned_at
            rep.state = "failed"
            self.ended.append(rep)
            raise ReplicaStartError(f"replica {name}: its command could not be started: {exc}", rep) from None
        rep.proc, rep.pid = proc, proc.pid
        self._procs[proc.pid] = proc
        self._live.append(rep)
        log.info("replica provider: started %s (pid %d) on %s: %s", name, proc.pid, rep.url, " ".join(argv))
        try:
            await self._until_healthy(rep)
        except BaseException as exc:  # a failure, a timeout, or the step cancelled at shutdown: nothing may leak
            with contextlib.suppress(KeyError, ValueError):
                self.pool.remove(name)
            await self._terminate(rep)
            self._end(rep, "failed")
            self.failed += 1
            if not isinstance(exc, Exception):  # cancelled (the gateway's end): stopped, and on with the cancel
                raise
            why = str(exc) if isinstance(exc, ReplicaStartError) else f"replica {name}: {type(exc).__name__}: {exc}"
            raise ReplicaStartError(f"{why}; its process was stopped (exit status {rep.exit_status})", rep,
                                    _tail(rep.log_path)) from None
        rep.state = "serving"
        rep.serving_at = time.monotonic()
        self.started += 1
        self._changed()
        log.info("replica provider: %s serves on %s after %.2f s", name, rep.url, rep.started_in_s or 0.0)
        return rep

    async def _until_healthy(self, rep: ProvidedReplica) -> None:
        """Wait until the replica answers ``health_path`` with 200 and then passes the pool's own health check of its
        engine (tailguard's /ready, vLLM's /health, ...), within ``start_timeout_s`` of its start."""
        cfg, proc = self.cfg, rep.proc
        assert proc is not None
        deadline = rep.spawned_at + cfg.start_timeout_s

        def gone() -> ReplicaStartError | None:
            if self.closed:
                return ReplicaStartError(f"replica {rep.name}: the gateway is shutting down")
            code = proc.poll()
            if code is not None:
                return ReplicaStartError(f"replica {rep.name} exited with status {code} before it became healthy")
            return None

        def late(what: str) -> ReplicaStartError:
            return ReplicaStartError(f"replica {rep.name} did not become healthy within {cfg.start_timeout_s:g} s "
                                     f"({what})")

        while not await _answers_200(rep.port, cfg.health_path):
            if (err := gone()) is not None:
                raise err
            if time.monotonic() >= deadline:
                raise late(f"{rep.url}{cfg.health_path} never answered 200")
            await asyncio.sleep(0.1)
        up = UpstreamConfig(url=rep.url, name=rep.name, max_concurrent=cfg.max_concurrent, kind=cfg.engine,
                            send_priority=cfg.send_priority, preempts=cfg.preempts)
        r = await self.pool.add(up)  # health-checked before it takes traffic
        while not r.healthy:
            if (err := gone()) is not None:
                raise err
            if time.monotonic() >= deadline:
                raise late(f"the gateway's health check says: {r.last_error or 'unhealthy'}")
            await asyncio.sleep(0.1)
            await self.pool.check(r)

    # --- stop -------------------------------------------------------------------------------------------------------
    async def stop_replica(self, name: str | None = None) -> StopReport:
        """Drain one replica (``name``, or the newest serving one), take it out of the pool, stop its process."""
        if name is None:
            serving = [r for r in self._live if r.state == "serving"]
            if not serving:
                raise KeyError("no replica started by the provider is serving")
            rep = serving[-1]
        else:
            found = next((r for r in self._live if r.name == name), None)
            if found is None:
                raise KeyError(name)
            if found.state != "serving":
                raise ValueError(f"{name} is {found.state}: it is being started or stopped already")
            rep = found
        in_pool: Replica | None = next((r for r in self.pool.replicas if r.name == rep.name), None)
        if in_pool is not None and not any(r is not in_pool and not r.draining for r in self.pool.replicas):
            raise ValueError(f"{rep.name} is the gateway's last replica: it is not stopped")
        prev, rep.state = rep.state, "draining"
        t0 = time.monotonic()
        drained = left = 0
        if in_pool is not None:
            in_pool.draining = True
            self._changed()
            try:
                began, left = await self.pool.drain(rep.name, self.cfg.drain_timeout_s)
            except BaseException:
                in_pool.draining = False
                rep.state = prev
                raise
            drained = began - left
            try:
                self.pool.remove(rep.name)
            except KeyError:
                pass  # noqa: SIM105 - taken out meanwhile (the admin API)
            except ValueError:  # the others were taken out meanwhile: it serves on
                in_pool.draining = False
                rep.state = prev
                self._changed()
                raise
        drain_s = time.monotonic() - t0
        killed = await self._terminate(rep)
        self._end(rep, "stopped")
        self._changed()
        log.info("replica provider: stopped %s after draining %s in %.2f s (%d left)", rep.name,
                 _plural(drained, "request"), drain_s, left)
        return StopReport(rep.name, rep.url, drained, left, drain_s, rep.exit_status, killed, rep.alive_s())

    async def _terminate(self, rep: ProvidedReplica) -> bool:
        """SIGTERM its process group, SIGKILL after ``stop_grace_s``; True when it took the SIGKILL."""
        proc = rep.proc
        if proc is None:
            return False
        killed = False
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            deadline = time.monotonic() + self.cfg.stop_grace_s
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            killed = proc.poll() is None
        _signal_group(proc, signal.SIGKILL)  # the leader is gone: anything left of its group goes too
        while proc.poll() is None:
            await asyncio.sleep(0.02)
        return killed

    def reap(self) -> list[ProvidedReplica]:
        """Replicas whose process ended on its own: out of the pool, their cost closed. Returns them."""
        gone = [r for r in self._live if r.state == "serving" and r.proc is not None and r.proc.poll() is not None]
        for rep in gone:
            log.warning("replica provider: %s exited on its own (status %s)", rep.name, rep.proc and rep.proc.poll())
            with contextlib.suppress(KeyError, ValueError):
                self.pool.remove(rep.name)
            self._end(rep, "exited")
        if gone:
            self._changed()
        return gone

    # --- scale steps --------------------------------------------------------------------------------------------------
    async def scale(self, delta_pct: float, on_result: Callable[[Result], None] | None = None,
                    replicas: int | None = None) -> list[Result]:
        """Start (``delta_pct`` > 0) or stop replicas: ``delta_pct`` of those serving, rounded up, at least one (or
        exactly ``replicas``), within ``min_replicas`` and ``max_replicas``. One result per replica (and one when
        nothing could be done), each handed to ``on_result`` as it comes."""
        if self._step is None:
            self._step = asyncio.Lock()
        async with self._step:
            self.reap()
            base = sum(1 for r in self.pool.replicas if not r.draining)
            # Up to max_replicas counts those still draining (they run, and cost); down to min_replicas does not.
            running = len(self._live) if delta_pct > 0 else sum(1 for r in self._live if r.state == "serving")
            n, wanted, why = plan_scale(delta_pct, base, running, self.min_replicas, self.max_replicas,
                                        replicas)
            results: list[Result] = []

            def emit(res: Result) -> None:
                res.update(target="provider", provider=self.kind, wanted=wanted)
                if replicas is None:
                    res["replicas_delta_pct"] = delta_pct
                else:
                    res["replicas_delta"] = replicas if delta_pct > 0 else -replicas
                if why is not None:
                    res["bound"] = why
                results.append(res)
                if on_result is not None:
                    on_result(res)

            if n == 0:
                verb = "started" if delta_pct > 0 else "stopped"
                emit({"ok": True, "event": "skipped", "message": f"no replica {verb}: {why}"})
                return results
            if n > 0:
                await asyncio.gather(*(self._start_step(emit) for _ in range(n)))
            else:
                victims = [r for r in self._live if r.state == "serving"][n:]  # the newest first out
                await asyncio.gather(*(self._stop_step(r.name, emit) for r in reversed(victims)))
            return results

    async def _start_step(self, emit: Callable[[Result], None]) -> None:
        try:
            rep = await self.start_replica()
        except ReplicaStartError as exc:
            res: Result = {"ok": False, "error": str(exc)[:500]}
            if exc.replica is not None:
                res.update(replica=exc.replica.name, url=exc.replica.url, log=exc.replica.log_path,
                           exit_status=exc.replica.exit_status)
            if exc.output:
                res["output"] = exc.output[-500:]
            emit(res)
            return
        emit({"ok": True, "replica": rep.name, "url": rep.url, "pid": rep.pid,
              "started_in_s": _round(rep.started_in_s), "replicas": len(self.pool.replicas),
              "message": f"started replica {rep.name} at {rep.url} in {rep.started_in_s or 0.0:.2f} s"})

    async def _stop_step(self, name: str, emit: Callable[[Result], None]) -> None:
        try:
            rep = await self.stop_replica(name)
        except Exception as exc:  # noqa: BLE001 - reported in the step's record (KeyError: gone meanwhile)
            emit({"ok": False, "replica": name, "error": f"replica {name} was not stopped: {exc}"[:500]})
            return
        msg = (f"stopped replica {rep.name} after draining {_plural(rep.drained, 'request')} in {rep.drain_s:.2f} s"
               + (f"; the drain timeout cut {_plural(rep.left, 'request')} off" if rep.left else "")
               + (f"; it took SIGKILL after {self.cfg.stop_grace_s:g} s" if rep.killed else "")
               + f" (alive {rep.alive_s:.1f} s)")
        emit({"ok": True, "replica": rep.name, "url": rep.url, "drained_requests": rep.drained,
              "cut_off_requests": rep.left, "drain_s": _round(rep.drain_s), "exit_status": rep.exit_status,
              "killed": rep.killed, "alive_s": _round(rep.alive_s), "replicas": len(self.pool.replicas),
              "message": msg})

    def keep_minimum(self) -> asyncio.Task | None:
        """Start replicas up to ``min_replicas`` in the background (the gateway's start). Call on the event loop."""
        missing = self.min_replicas - len(self._live)
        if missing <= 0 or self._keep_min is not None:
            return self._keep_min

        async def run() -> None:
            if self._step is None:
                self._step = asyncio.Lock()
            async with self._step:
                results = await asyncio.gather(*(self.start_replica() for _ in range(missing)),
                                               return_exceptions=True)
            for res in results:
                if isinstance(res, BaseException):
                    log.error("replica provider: a replica for min_replicas did not start: %s", res)

        self._keep_min = asyncio.get_running_loop().create_task(run())
        return self._keep_min

    def close_now(self) -> None:
        """Stop every replica process at once (the gateway's shutdown: its own requests have drained). Any thread."""
        self.closed = True
        _kill_all(self._procs, self.cfg.stop_grace_s)
        for rep in list(self._live):
            self._end(rep, "stopped")


# --- the SLO monitor's side ------------------------------------------------------------------------------------------
class ProviderScaler:
    """A provider as the SLO actions' scaler (``tailguard.slo.actions.Scaler``): ``submit`` from any thread runs the
    scale step on the gateway's event loop and hands each result to ``done`` there, as it comes. ``fires``: whether
    this gateway acts (in a fleet, only the leader does, as with the hooks)."""

    def __init__(self, provider: ReplicaProvider, loop: asyncio.AbstractEventLoop,
                 fires: Callable[[], bool] | None = None) -> None:
        self.provider = provider
        self.loop = loop
        self.fires = fires
        self.on_close: list[Callable[[], None]] = []  # what else stops with it (the backlog autoscaler)
        self._pending: set[concurrent.futures.Future] = set()
        self._lock = threading.Lock()

    def submit(self, payload: dict[str, Any], done: Callable[[Result], None]) -> None:
        if self.fires is not None and not self.fires():
            return
        delta = float(payload.get("replicas_delta_pct") or 0.0)
        try:
            fut = asyncio.run_coroutine_threadsafe(self._run(delta, done), self.loop)
        except RuntimeError as exc:  # the loop has closed: the gateway is gone
            done({"target": "provider", "provider": self.provider.kind, "ok": False,
                  "error": f"the gateway's event loop is closed: {exc}"})
            return
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._forget)

    def _forget(self, fut: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending.discard(fut)

    async def _run(self, delta_pct: float, done: Callable[[Result], None]) -> None:
        def hand(res: Result) -> None:
            try:
                done(res)
            except Exception:  # noqa: BLE001 - the record's sink must not stop the step
                log.exception("replica provider: result callback failed")

        if not delta_pct:
            return
        try:
            await self.provider.scale(delta_pct, hand)
        except Exception as exc:  # noqa: BLE001 - reported as a failed step, never raised into the loop
            log.exception("replica provider: scale step failed")
            hand({"target": "provider", "provider": self.provider.kind, "ok": False,
                  "error": f"{type(exc).__name__}: {exc}"[:500]})

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every submitted step has finished (tests)."""
        with self._lock:
            pending = list(self._pending)
        _, not_done = concurrent.futures.wait(pending, timeout)
        return not not_done

    def close(self) -> None:
        for stop in self.on_close:
            stop()
        for fut in list(self._pending):
            fut.cancel()
        self.provider.close_now()


# --- replica-seconds -------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Held:
    """A replica of the pool the provider did not start, as the ledger last saw it."""

    replica: Replica
    seen_at: float
    healthy: bool
    alive_s: float = 0.0


class ReplicaLedger:
    """Replica-seconds: how long each replica has been alive, summed. A replica the provider started counts from the
    start of its process to its end (start-up and drain included: it costs all along); any other (configured, or
    added through the admin API) while it is in the pool and passes its health checks (a replica the gateway cannot
    reach, such as a pod not scheduled yet, costs nothing it can see). ``sync`` catches up with the pool; the server
    calls it as it samples (every ``sample_interval``) and after each change through the admin API."""

    def __init__(self, pool: UpstreamPool, provider: ReplicaProvider | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.provider = provider
        self.clock = clock
        self._held: dict[int, _Held] = {}  # id(replica) -> what was seen of it (the entry keeps the id taken)
        self.static_ended_s = 0.0  # of the replicas that have left the pool
        self._lock = threading.Lock()
        self.model: Callable[[], str] = lambda: "upstream"
        self.sync()

    def _provided(self, r: Replica) -> bool:
        return self.provider is not None and self.provider.owns(r.url)

    def sync(self) -> None:
        now = self.clock()
        current = {id(r): r for r in list(self.pool.replicas) if not self._provided(r)}
        with self._lock:
            for key, h in list(self._held.items()):
                if h.healthy:  # alive since the last look
                    h.alive_s += now - h.seen_at
                h.seen_at = now
                if key in current:
                    h.healthy = h.replica.healthy
                else:
                    self.static_ended_s += h.alive_s
                    del self._held[key]
            for key, r in current.items():
                if key not in self._held:
                    self._held[key] = _Held(r, now, r.healthy)

    def _alive(self, h: _Held, now: float) -> float:
        return h.alive_s + (now - h.seen_at if h.healthy else 0.0)

    def seconds(self) -> dict[str, float]:
        """Replica-seconds so far: ``static`` (configured and admin-added), ``provider``, and ``total``."""
        now = self.clock()
        with self._lock:
            static = self.static_ended_s + sum(self._alive(h, now) for h in self._held.values())
        provided = self.provider.replica_seconds() if self.provider is not None else 0.0
        return {"static": static, "provider": provided, "total": static + provided}

    def entry(self, r: Replica) -> dict[str, Any]:
        """What ``/admin/upstreams`` adds to one replica: where it came from and how long it has been alive."""
        if self._provided(r):
            assert self.provider is not None
            own = next((p for p in self.provider.replicas() if p.url == r.url), None)
            return {"source": "provider", "alive_s": _round(own.alive_s()) if own else None,
                    "provider_state": own.state if own else None}
        with self._lock:
            h = self._held.get(id(r))
            alive = None if h is None else self._alive(h, self.clock())
        return {"source": "static", "alive_s": _round(alive)}

    def summary(self) -> dict[str, Any]:
        return {k: _round(v) for k, v in self.seconds().items()}

    # --- Prometheus (a custom collector: the figures are computed at each scrape, never stale) ------------------
    def register(self, registry: Any, model: Callable[[], str]) -> None:
        self.model = model
        registry.register(self)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m = self.model()
        secs = CounterMetricFamily("tailguard_gateway_replica_seconds",
                                   "Replica-seconds: the time each replica has been alive, summed (source: static, "
                                   "the configured and admin-added replicas, while they pass their health checks; "
                                   "provider, the replicas it started, start-up and drain included).",
                                   labels=["model", "source"])
        count = GaugeMetricFamily("tailguard_gateway_replicas", "Replicas by source and state (starting, serving, "
                                  "draining, unavailable).", labels=["model", "source", "state"])
        s = self.seconds()
        secs.add_metric([m, "static"], s["static"])
        secs.add_metric([m, "provider"], s["provider"])
        yield secs
        states: dict[tuple[str, str], int] = {}
        pooled = {r.url: r for r in list(self.pool.replicas)}
        for r in pooled.values():
            if self._provided(r):
                continue
            st = "draining" if r.draining else "serving" if r.available else "unavailable"
            states[("static", st)] = states.get(("static", st), 0) + 1
        for p in self.provider.replicas() if self.provider is not None else []:
            r2 = pooled.get(p.url)
            st = p.state if p.state in ("starting", "draining") else (
                "serving" if r2 is not None and r2.available else "unavailable")
            states[("provider", st)] = states.get(("provider", st), 0) + 1
        for source in ("static", "provider"):
            for st in ("starting", "serving", "draining", "unavailable"):
                count.add_metric([m, source, st], states.get((source, st), 0))
        yield count
