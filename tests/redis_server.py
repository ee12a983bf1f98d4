"""A throwaway Redis server for the fleet's tests, example and benchmark: ``redis-server`` on a free port of
127.0.0.1, no persistence, its files in a temporary directory; stopped (or killed, to play a crash) on demand.

Nothing depends on a system Redis service: only the binary (Debian's ``redis-server`` package; scripts/test.sh
installs it).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.net import free_port


class RedisUnavailable(RuntimeError):
    """No redis-server binary on this machine."""



class RedisServer:
    def __init__(self, port: int | None = None) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RedisUnavailable("redis-server is not installed (Debian: apt-get install redis-server)")
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="tailguard-redis-"))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.dir), "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.proc.stderr.read().decode()[-1000:]}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return self
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer PING within 10 s")

    def kill(self) -> None:
        """SIGKILL: the server is gone at once, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()
