"""The direct relay: a plain token written to the client from the upstream connection's read callback.

Relaying a token the general way costs a wake-up of the request's task and a pass through three async generators
(the upstream attempt, the retry loop, the server's stream), each with its own bookkeeping, before the chunk is
handed to the ASGI server. Most of a stream's chunks need none of it: after the first token, a plain token chunk
(``backends/upstream/sse.py``: one text, no finish reason, no usage) becomes one chunk to the client and two timestamps. So
while the server's stream is waiting for its next event, and nothing read before is still waiting for it, such a
token is written by the ``Relay`` the server armed, inside the read callback; anything else (the role chunk, the
first token, the last chunks, an error, a token behind one of those, a token the relay refuses) is queued for the
reader as before, in order. Measured in CHANGELOG.md (2026-12-04, the direct relay).

``UpstreamFeed`` is one attempt's side of it: it takes the body as the connection receives it (the connection's
``tap``), splits it into ``data:`` payloads and either relays or queues each. An attempt's first token is always
queued for the reader, and also written at once (``Relay.first_token``) when the server's stream is waiting for it
with nothing else to send first; a plain chunk without a token before it (the role chunk) is dropped.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from tailguard.backends.upstream.http1 import HIGH_WATER
from tailguard.backends.upstream.sse import DONE, SSELines, SSELineTooLong, TokenTexts

log = logging.getLogger("tailguard.gateway")


class Relay(Protocol):
    """The client's side: armed by the server only while its stream waits for the next event."""

    armed: bool
    on_token: Callable[[], None] | None  # told of each token taken (the stall watch's inter-token clock)
    sink: list[str] | None  # each token's text appended (a stall fallback's continuation)
    # Set by the server while its stream waits for the request's first token, with its status out: the encoder of
    # the role chunk and the first token's chunk (``first_token``); None otherwise.
    opening: Callable[[str], bytes] | None

    def token(self, text: str, produced: float) -> bool:
        """Write one token's chunk now; False (nothing written) when it cannot, and the token goes to the reader."""

    def first_token(self, text: str) -> bool:
        """Write the first token (and the role chunk before it) now, from the read callback; the reader still gets
        the token, for everything else a token means. False (nothing written) when it cannot."""


class UpstreamFeed:
    """One attempt's stream as payloads: relayed directly when the relay allows, else queued for the reader.

    ``queue`` holds (payload, arrival time) in arrival order; ``relayed`` counts the tokens written directly (the
    attempt's token count includes them). The attempt's first token is always the reader's: until it has passed, the
    server's stream and the stall watch (whose first-token phase is not told of relayed tokens) must see every token;
    this matters for a stall fallback's continuation, which starts while the relay is already armed."""

    __slots__ = ("lines", "token_text", "relay", "queue", "queued_bytes", "relayed", "ended", "opened", "_conn",
                 "_replica", "failed", "left")

    def __init__(self, chat: bool, relay: Relay | None, conn: object | None = None, replica: object | None = None,
                 charge: int = 0) -> None:
        self.lines = SSELines()
        self.token_text = TokenTexts(chat)
        self.relay = relay
        self.queue: deque[tuple[bytes, float]] = deque()
        self.queued_bytes = 0
        self.relayed = 0
        self.ended = False  # [DONE] came: nothing after it is relayed
        self.opened = False  # the attempt's first token was queued for the reader: later ones may be relayed
        self._conn = conn  # paused while the reader is behind (``pause_reading``)
        self._replica = replica  # its outstanding tokens count down as they come (routing reads them)
        self.failed: SSELineTooLong | None = None  # the stream broke the SSE rules: nothing more is read of it
        self.left = charge  # of the tokens this attempt added to the replica's outstanding ones, not yet counted down

    def __call__(self, data: bytes) -> bool:
        """Take one piece of the body; True when something was queued for the reader."""
        if self.failed is not None:
            return False
        now = time.perf_counter()
        queue, relay = self.queue, self.relay
        queued = False
        try:
            payloads = self.lines.feed(data)
        except SSELineTooLong as exc:  # inside the connection's read callback: the reader raises it
            self.failed = exc
            if self._conn is not None:
                self._conn.pause_reading(True)  # type: ignore[attr-defined]
            return True
        for payload in payloads:
            if relay is not None and relay.armed and not queue and not self.ended and self.opened:
                text = self.token_text(payload)
                if text and self._relayed(relay, text, now):
                    self.relayed += 1
                    self.release(1)
                    continue
            if payload == DONE:
                self.ended = True
            elif not self.opened:
                text = self.token_text(payload)
                if text == "":  # a plain chunk without a token (the role chunk): nothing in it for anyone
                    continue
                if text:
                    self.opened = True
                    if relay is not None and relay.opening is not None and not queue:
                        self._first(relay, text)  # out at once; queued all the same, for the reader's bookkeeping
            queue.append((payload, now))
            self.queued_bytes += len(payload)
            queued = True
        if self.queued_bytes > HIGH_WATER and self._conn is not None:
            self._conn.pause_reading(True)  # type: ignore[attr-defined]
        return queued

    def release(self, n: int) -> None:
        """Count ``n`` tokens that came down from the replica's outstanding ones, never past what this attempt added."""
        n = min(n, self.left)
        if n > 0:
            self.left -= n
            if self._replica is not None:
                self._replica.outstanding_tokens -= n  # type: ignore[attr-defined]

    @staticmethod
    def _relayed(relay: Relay, text: str, now: float) -> bool:
        try:
            return relay.token(text, now)
        except Exception:  # noqa: BLE001 - inside the connection's read callback: the token goes the general way
            log.exception("direct relay: a token could not be taken; the relay is off for this wait")
            relay.armed = False
            return False

    @staticmethod
    def _first(relay: Relay, text: str) -> None:
        try:
            relay.first_token(text)
        except Exception:  # noqa: BLE001 - inside the connection's read callback: the reader sends it instead
            log.exception("direct relay: the first token could not be written; the stream sends it")
            relay.opening = None

    def take(self) -> list[tuple[bytes, float]]:
        """Everything queued, oldest first (and the socket read again if it was paused for it)."""
        out = list(self.queue)
        self.queue.clear()
        if out and self.relay is not None:
            # What the reader takes is on its way to the server's stream, which stops waiting for it: a token read
            # before that stream has written these must not be relayed past them (the server arms the relay again
            # when its stream waits again).
            self.relay.armed = False
        if self.queued_bytes > HIGH_WATER and self._conn is not None:
            self._conn.pause_reading(False)  # type: ignore[attr-defined]
        self.queued_bytes = 0
        return out

    def end(self) -> list[tuple[bytes, float]]:
        """At the body's end: the last line, if the stream did not end it."""
        if not self.lines.pending:
            return []
        return [(p, time.perf_counter()) for p in self.lines.feed(b"\n")]
