"""The client's side of the gateway's direct relay (``backends/upstream/relay.py``): a token's chunk taken from the upstream read
callback and written on the client's connection past the ASGI ``send``, at the end of the event loop's turn.

Only under uvicorn's httptools protocol (the server ``tailguard serve`` runs), whose response cycle is the ``send``
callable's object: its transport, its chunked framing and its flow control are read from it. Under any other server,
or with a middleware wrapping ``send`` (tracing), ``for_send`` gives None and every token goes through ``send``.

A token is refused (False: the caller queues it for the server's stream, which sends it the usual way, in order)
when the relay is not armed, the client has gone, the response is complete or not chunked, or the client's socket
buffer is above uvicorn's high-water mark (its ``send`` would wait there: the wait is the stream's to do).

**When the bytes leave.** Not inside the read callback: uvloop runs every read callback of a poll before any task
that the poll made ready, so writing there put each burst of tokens ahead of the new requests' first steps and the
first tokens (the TTFT path) that arrived with it: in paired rounds at 256 streams the added P99 TTFT rose by ~1 ms
over the relay-free path. A ``RelayFlusher`` holds the accepted chunks and writes them, in order, one turn later,
after the tasks of the turn that received them (``serving/next_turn.py``; CHANGELOG.md, 2026-12-04, the direct relay).
The server's stream flushes whatever is held before it writes anything itself (``settle``), so nothing overtakes.

**The first token is the exception** (``first_token``): it is the TTFT, so it leaves inside the read callback, with
the role chunk before it, while the server's stream waits for it with the status already out (the server sets
``opening`` only then). The token still goes to the reader, which does everything else a first token means (the
timeline, the queue slot, the stall watch, the retry rule) and writes nothing. Measured in docs/gateway.md ("What
relaying costs").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from tailguard.observe.timeline import Timeline
from tailguard.serving.next_turn import NextTurn

log = logging.getLogger("tailguard.gateway")
perf_counter = time.perf_counter
_UVICORN_CYCLE = ("uvicorn.protocols.http.httptools_impl", "RequestResponseCycle")


class RelayFlusher(NextTurn["tuple[ClientRelay, bytes]"]):
    """The chunks the relays of one event loop accepted, written after the ready work of the turn that took them."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(self._write)

    @staticmethod
    def _write(item: tuple[ClientRelay, bytes]) -> None:
        relay, data = item
        transport = relay._cycle.transport
        if transport.is_closing():
            return
        try:
            transport.write(data)
        except Exception:  # noqa: BLE001 - one client's broken connection must not cost the others their tokens
            log.warning("direct relay: a write failed; the stream's own path reports the connection", exc_info=True)
            return
        relay._tl.token_sent.append(perf_counter())  # type: ignore[union-attr]


class ClientRelay:
    """Takes token chunks for the client's connection while ``armed`` (set by the server's stream)."""

    __slots__ = ("armed", "on_token", "sink", "taken", "opening", "first_sent", "_cycle", "_flusher", "_tl",
                 "_content", "_output")

    def __init__(self, cycle: Any, flusher: RelayFlusher) -> None:
        self.armed = False
        self.on_token: Callable[[], None] | None = None  # the stall watch's clock: a token came (``watch``)
        self.sink: list[str] | None = None  # the texts sent, for a stall fallback's continuation (``stall_fallback``)
        self.taken = 0  # tokens relayed, every attempt of the request together (the record's direct_tokens)
        self.opening: Callable[[str], bytes] | None = None  # set while the stream waits for the first token
        self.first_sent: float | None = None  # when ``first_token`` wrote the first token
        self._cycle = cycle
        self._flusher = flusher
        self._tl: Timeline | None = None
        self._content: Callable[[str], bytes] | None = None
        self._output: list[str] | None = None

    @classmethod
    def for_send(cls, send: Any, flusher: RelayFlusher) -> ClientRelay | None:
        cycle = getattr(send, "__self__", None)
        kind = type(cycle)
        if (kind.__module__, kind.__name__) != _UVICORN_CYCLE or not hasattr(cycle, "transport"):
            return None
        return cls(cycle, flusher)

    def bind(self, tl: Timeline, content: Callable[[str], bytes], output: list[str] | None) -> None:
        """What a token needs: the timeline its times go on, the chunk's encoder, the kept text (or None)."""
        self._tl, self._content, self._output = tl, content, output

    def _refused(self) -> bool:
        """The response cannot take a chunk past ``send``: the client has gone, the body is complete or not chunked,
        or the client is behind (``send`` would wait: the wait is the stream's to do)."""
        cycle = self._cycle
        return cycle.disconnected or cycle.response_complete or not cycle.chunked_encoding or cycle.flow.write_paused

    @staticmethod
    def _framed(chunk: bytes) -> bytes:
        return b"%x\r\n%b\r\n" % (len(chunk), chunk)  # uvicorn's chunk framing

    def token(self, text: str, produced: float) -> bool:
        if not self.armed or self._refused():
            return False
        assert self._content is not None and self._tl is not None
        chunk = self._content(text)
        self._flusher.add((self, self._framed(chunk)))
        self._tl.token_times.append(produced)
        self.taken += 1
        if self._output is not None:
            self._output.append(text)
        if self.sink is not None:
            self.sink.append(text)
        if self.on_token is not None:
            self.on_token()
        return True

    def first_token(self, text: str) -> bool:
        """The role chunk and the first token's chunk, written now, inside the read callback: ahead of the work the
        read made ready, as nothing else is (the first token is the TTFT; the later tokens wait a turn, above)."""
        encode, transport = self.opening, self._cycle.transport
        if encode is None or self._refused() or transport.is_closing():
            return False
        self.opening = None
        transport.write(self._framed(encode(text)))
        self.first_sent = perf_counter()
        return True

    def settle(self) -> None:
        """Write what is held now: the server's stream is about to write (its own chunks must come after)."""
        if self._flusher.pending:
            self._flusher.flush()
