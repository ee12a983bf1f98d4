"""The client's side of the gateway's direct relay (``gateway/relay.py``): a token's chunk written on the client's
connection at once, from the upstream read callback, past the ASGI ``send``.

Only under uvicorn's httptools protocol (the server ``tailguard serve`` runs), whose response cycle is the ``send``
callable's object: its transport, its chunked framing and its flow control are read from it. Under any other server,
or with a middleware wrapping ``send`` (tracing), ``for_send`` gives None and every token goes through ``send``.

A token is refused (False: the caller queues it for the server's stream, which sends it the usual way, in order)
when the relay is not armed, the client has gone, the response is complete or not chunked, or the client's socket
buffer is above uvicorn's high-water mark (its ``send`` would wait there: the wait is the stream's to do).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tailguard.observe.timeline import Timeline

perf_counter = time.perf_counter
_UVICORN_CYCLE = ("uvicorn.protocols.http.httptools_impl", "RequestResponseCycle")


class ClientRelay:
    """Writes token chunks on the client's connection while ``armed`` (set by the server's stream)."""

    __slots__ = ("armed", "_cycle", "_tl", "_content", "_output")

    def __init__(self, cycle: Any) -> None:
        self.armed = False
        self._cycle = cycle
        self._tl: Timeline | None = None
        self._content: Callable[[str], bytes] | None = None
        self._output: list[str] | None = None

    @classmethod
    def for_send(cls, send: Any) -> ClientRelay | None:
        cycle = getattr(send, "__self__", None)
        kind = type(cycle)
        if (kind.__module__, kind.__name__) != _UVICORN_CYCLE or not hasattr(cycle, "transport"):
            return None
        return cls(cycle)

    def bind(self, tl: Timeline, content: Callable[[str], bytes], output: list[str] | None) -> None:
        """What a token needs: the timeline its times go on, the chunk's encoder, the kept text (or None)."""
        self._tl, self._content, self._output = tl, content, output

    def token(self, text: str, produced: float) -> bool:
        cycle = self._cycle
        if not self.armed or cycle.disconnected or cycle.response_complete or not cycle.chunked_encoding \
                or cycle.flow.write_paused:
            return False
        assert self._content is not None and self._tl is not None
        chunk = self._content(text)
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))  # uvicorn's chunk framing
        tl = self._tl
        tl.token_times.append(produced)
        tl.token_sent.append(perf_counter())
        if self._output is not None:
            self._output.append(text)
        return True
