"""The server's prompt tokenizing: prompts that arrive together are encoded together, off the event loop, and a
domain glossary is kept pre-tokenized in the tokenizer's cache.

- ``TokenizeBatcher``: a cache hit is answered at once. A miss joins the pending batch; the batch goes when the
  arrivals of the current turn of the event loop have joined it (``window_s`` 0, the default: no timer) or after
  ``window_s``. One batch is encoded at a time, on the batcher's own thread, with the tokenizer's batch encode (HF
  ``tokenizers``' ``encode_batch``: parallel in Rust, without the GIL); arrivals during it form the next batch. A
  text of at most ``inline_chars`` characters is encoded on the loop at once: cheaper than the thread hop
  (benchmarks/tokenize_cost.py). Ids are the tokenizer's own either way (``GGUFTokenizer.encode_many``).
- ``GlossaryFile``: one term a line (blank lines and lines starting with ``#`` skipped), pinned in the tokenizer's
  cache when the server starts, and again when the file changes (its modification time, size or inode, polled) or
  on ``POST /admin/tokenizer/glossary``. It only spares work: tokenization is the same with it and without it.

Prompts longer than ``tokenize_in_thread_chars`` keep their own path (serving/prompt.py): one at a time on a worker
thread, so that a huge one never holds up a batch of short ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tailguard.serving.state import ServerState

log = logging.getLogger("tailguard.server")

# A batch stops growing at this many characters (8-30 ms of encoding on one core, English to Chinese): the first
# prompts of a big burst do not wait for the encoding of the last; arrivals beyond it go in the next batch.
MAX_BATCH_CHARS = 32 * 1024
# The largest glossary file read (a big clinical term list is a few MB).
MAX_GLOSSARY_FILE_BYTES = 64 * 1024 * 1024

_Result = list[int] | BaseException


def encode_error(text: str, exc: BaseException) -> BaseException:
    """A lone surrogate is rejected by the Rust tokenizer as a TypeError; say what it is (serving/prompt.py words
    it for the client)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as bad:
        return bad
    return exc


def encode_texts(tok: Any, texts: list[str]) -> list[_Result]:
    """Each text's ids, or the exception it raised: one bad text fails only its own request, not its batch."""
    many = getattr(tok, "encode_many", None)
    try:
        if many is not None:
            return list(many(texts))
        return [tok.encode(t) for t in texts]
    except Exception:  # noqa: BLE001 - retried one by one below, where each error goes to its own request
        pass
    out: list[_Result] = []
    for text in texts:
        try:
            out.append(tok.encode(text))
        except Exception as exc:  # noqa: BLE001 - handed to the request that sent it
            out.append(encode_error(text, exc))
    return out


class TokenizeBatcher:
    """Micro-batches the encodes of prompts that arrive together (see the module's docstring)."""

    def __init__(self, tok: Any, window_s: float = 0.0, inline_chars: int = 256,
                 max_batch_chars: int = MAX_BATCH_CHARS) -> None:
        self.tok = tok
        self.window_s = window_s
        self.inline_chars = inline_chars
        self.max_batch_chars = max_batch_chars
        self._lookup: Callable[[str], list[int] | None] | None = getattr(tok, "lookup", None)
        self._pending: deque[tuple[str, asyncio.Future[list[int]]]] = deque()
        self._pending_chars = 0
        self._busy = False  # a batch is on the worker thread
        self._timer: asyncio.Handle | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False
        # Counters (GET /admin/tokenizer/glossary shows them).
        self.hits = 0  # answered from the cache, without waiting
        self.batches = 0  # sent to the worker thread
        self.batched_texts = 0  # texts in those batches
        self.inline = 0  # short texts encoded on the loop
        self.largest = 0  # the most texts one batch held

    async def encode(self, text: str) -> list[int]:
        if self._lookup is not None:
            hit = self._lookup(text)
            if hit is not None:
                self.hits += 1
                return hit
        if len(text) <= self.inline_chars:
            # Short: encoding it here costs the loop less than handing it to the thread and back would.
            self.inline += 1
            res = encode_texts(self.tok, [text])[0]
            if isinstance(res, BaseException):
                raise res
            return res
        if self._closed:
            raise RuntimeError("the server is shutting down")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[int]] = loop.create_future()
        self._pending.append((text, fut))
        self._pending_chars += len(text)
        if not self._busy:
            if self._pending_chars >= self.max_batch_chars:
                self._schedule(loop, 0.0)
            elif self._timer is None:
                self._schedule(loop, self.window_s)
        return await fut

    def _schedule(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        # call_soon runs after the callbacks already queued in this turn of the loop: the requests that arrived
        # together have reached here by then and share the batch, at no wait.
        self._timer = loop.call_soon(self._flush) if delay <= 0 else loop.call_later(delay, self._flush)

    def _take(self) -> list[tuple[str, asyncio.Future[list[int]]]]:
        batch: list[tuple[str, asyncio.Future[list[int]]]] = []
        chars = 0
        while self._pending and (not batch or chars + len(self._pending[0][0]) <= self.max_batch_chars):
            text, fut = self._pending.popleft()
            self._pending_chars -= len(text)
            if fut.done():  # its request went away (a client that hung up)
                continue
            batch.append((text, fut))
            chars += len(text)
        return batch

    def _flush(self) -> None:
        self._timer = None
        if self._busy or self._closed:
            return
        batch = self._take()
        if not batch:
            return
        texts = [t for t, _ in batch]
        self.largest = max(self.largest, len(batch))
        if self._executor is None:
            # Its own thread, not asyncio's shared pool: a batch never waits behind the store's or anyone's work.
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="tailguard-tokenize")
        self._busy = True
        self.batches += 1
        self.batched_texts += len(batch)
        loop = asyncio.get_running_loop()
        done = loop.run_in_executor(self._executor, encode_texts, self.tok, texts)
        done.add_done_callback(lambda f: self._done(batch, f))

    def _done(self, batch: list[tuple[str, asyncio.Future[list[int]]]], f: asyncio.Future[list[_Result]]) -> None:
        self._busy = False
        if f.cancelled():
            results: list[_Result] = [RuntimeError("the server is shutting down")] * len(batch)
        elif f.exception() is not None:
            results = [f.exception() or RuntimeError()] * len(batch)
        else:
            results = f.result()
        self._deliver(batch, results)
        if self._pending and not self._closed:
            self._flush()  # what arrived meanwhile is the next batch: it has waited long enough

    @staticmethod
    def _deliver(batch: list[tuple[str, asyncio.Future[list[int]]]], results: list[_Result]) -> None:
        for (_, fut), res in zip(batch, results):
            if fut.done():
                continue
            if isinstance(res, BaseException):
                fut.set_exception(res)
            else:
                fut.set_result(res)

    def describe(self) -> dict[str, Any]:
        return {"window_s": self.window_s, "inline_chars": self.inline_chars, "hits": self.hits,
                "batches": self.batches, "batched_texts": self.batched_texts, "inline": self.inline,
                "largest_batch": self.largest, "pending": len(self._pending)}

    def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._pending:
            _, fut = self._pending.popleft()
            if not fut.done():
                fut.set_exception(RuntimeError("the server is shutting down"))
        self._pending_chars = 0
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


def read_terms(path: str | os.PathLike[str]) -> list[str]:
    """A glossary file's terms: one a line, stripped; blank lines and ``#`` comment lines skipped; no repeats."""
    p = Path(path)
    with p.open("rb") as f:
        data = f.read(MAX_GLOSSARY_FILE_BYTES + 1)
    if len(data) > MAX_GLOSSARY_FILE_BYTES:
        raise ValueError(f"the glossary file is larger than {MAX_GLOSSARY_FILE_BYTES // (1024 * 1024)} MiB")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"the glossary file is not UTF-8 text (byte {exc.start})") from None
    terms = (line.strip() for line in text.splitlines())
    return list(dict.fromkeys(t for t in terms if t and not t.startswith("#")))


class GlossaryUnavailable(Exception):
    """This server has no tokenizer with a cache to pin a glossary in (a gateway, the scripted fake)."""


class GlossaryFile:
    """The glossary file: loaded into the tokenizer's cache, and loaded again when it changes."""

    def __init__(self, path: str, poll_s: float = 2.0) -> None:
        self.path = path
        self.poll_s = poll_s
        self._stamp: tuple[int, int, int] | None = None  # modification time (ns), size, inode of what was loaded
        self._lock = asyncio.Lock()
        self.terms = 0
        self.bytes = 0
        self.dropped = 0
        self.tokens = 0
        self.loaded_at: float | None = None  # unix time
        self.loads = 0
        self.error: str | None = None  # the last load's failure (the glossary before it stays)

    def _stat(self) -> tuple[int, int, int]:
        st = os.stat(self.path)
        return st.st_mtime_ns, st.st_size, st.st_ino

    async def load(self, tok: Any, force: bool = False) -> bool:
        """Pin the file's terms in ``tok``'s cache when it changed since the last load (or ``force``); True when
        loaded. Raises OSError or ValueError when the file cannot be read (the glossary before stays)."""
        if not hasattr(tok, "set_glossary"):
            raise GlossaryUnavailable("this backend's tokenizer keeps no cache to hold a glossary")
        async with self._lock:
            try:
                stamp = self._stat()  # before the read: a change during it is seen by the next poll
                if not force and stamp == self._stamp:
                    return False
                terms = await asyncio.to_thread(read_terms, self.path)
                stats = await asyncio.to_thread(tok.set_glossary, terms)
            except (OSError, ValueError) as exc:
                self.error = f"{type(exc).__name__}: {exc}" if isinstance(exc, OSError) else str(exc)
                raise
            self._stamp = stamp
            self.terms, self.bytes, self.dropped, self.tokens = stats.terms, stats.bytes, stats.dropped, stats.tokens
            self.loaded_at = time.time()
            self.loads += 1
            self.error = None
            log.info("tokenizer glossary %s: %d terms pinned (%d tokens, %.0f KiB)%s", self.path, stats.terms,
                     stats.tokens, stats.bytes / 1024, f", {stats.dropped} left out (over budget)"
                     if stats.dropped else "")
            return True

    def describe(self) -> dict[str, Any]:
        return {"path": self.path, "poll_s": self.poll_s, "terms": self.terms, "tokens": self.tokens,
                "bytes": self.bytes, "dropped": self.dropped, "loaded_at": self.loaded_at, "loads": self.loads,
                "error": self.error}


class TokenizePipeline:
    """The batcher and the glossary of one server (``pipeline_of(state)``)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        cfg = state.config
        self.batching = cfg.tokenize_batching
        self.glossary = GlossaryFile(cfg.tokenizer_glossary, cfg.tokenizer_glossary_poll_s) \
            if cfg.tokenizer_glossary else None
        self._batcher: TokenizeBatcher | None = None
        self._watch: asyncio.Task[None] | None = None
        self._pinned_in: Any | None = None  # the tokenizer our glossary was put in (emptied again at stop)

    def tokenizer(self) -> Any | None:
        return self.state.engine.tokenizer if self.state.engine is not None else None

    def batcher(self, tok: Any) -> TokenizeBatcher:
        b = self._batcher
        if b is None or b.tok is not tok:
            if b is not None:
                b.close()
            cfg = self.state.config
            b = self._batcher = TokenizeBatcher(tok, cfg.tokenize_batch_window_s, cfg.tokenize_inline_chars)
        return b

    async def encode(self, tok: Any, text: str) -> list[int]:
        """``text``'s ids, through the cache and the batcher (or on the loop, with batching off)."""
        if not self.batching:
            try:
                return tok.encode(text)
            except Exception as exc:  # noqa: BLE001 - reworded by the caller
                raise encode_error(text, exc) from None
        return await self.batcher(tok).encode(text)

    async def reload_glossary(self, force: bool = True) -> bool:
        """Load the glossary file again now (``POST /admin/tokenizer/glossary``)."""
        if self.glossary is None:
            raise GlossaryUnavailable("no glossary file is configured (--tokenizer-glossary)")
        tok = self.tokenizer()
        if tok is None:
            raise GlossaryUnavailable("this server does not tokenize prompts (a gateway: its replicas do)")
        loaded = await self.glossary.load(tok, force=force)
        self._pinned_in = tok
        return loaded

    async def start(self) -> None:
        """Load the glossary and watch its file."""
        if self.glossary is None:
            return
        # The first load, before the server answers when the backend is already attached; else once it is.
        if self.state.engine is not None and not await self._load_logged():
            return
        self._watch = asyncio.create_task(self._poll())

    async def _load_logged(self) -> bool:
        """Load the glossary if its file changed; False when this server cannot hold one (then stop polling)."""
        assert self.glossary is not None
        before = self.glossary.error
        try:
            await self.reload_glossary(force=False)
        except GlossaryUnavailable as exc:
            log.warning("tokenizer glossary not used: %s", exc)
            self.glossary.error = str(exc)
            return False
        except (OSError, ValueError) as exc:
            if self.glossary.error != before:  # once a failure, not at every poll
                log.warning("tokenizer glossary %s not loaded (the terms before stay): %s", self.glossary.path, exc)
        return True

    async def _poll(self) -> None:
        assert self.glossary is not None
        while self.state.engine is None:
            if self.state.load_error is not None:
                return
            await asyncio.sleep(0.05)  # the model still loading
        while await self._load_logged():
            await asyncio.sleep(self.glossary.poll_s)

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None
        if self._batcher is not None:
            self._batcher.close()
            self._batcher = None
        if self._pinned_in is not None:  # the tokenizer may outlive this server (an engine shared by tests)
            await asyncio.to_thread(self._pinned_in.set_glossary, [])
            self._pinned_in = None

    def describe(self) -> dict[str, Any]:
        tok = self.tokenizer()
        stats = getattr(tok, "cache_stats", None)
        return {"object": "tokenizer.glossary",
                "glossary": self.glossary.describe() if self.glossary is not None else None,
                "cache": stats() if stats is not None else None,
                "batching": self._batcher.describe() if self._batcher is not None and self.batching else None}


_ATTR = "tokenize_pipeline"


def pipeline_of(state: ServerState) -> TokenizePipeline:
    """The server's pipeline, made on first use (kept on the state object, beside its fields)."""
    pipeline = getattr(state, _ATTR, None)
    if pipeline is None:
        pipeline = TokenizePipeline(state)
        setattr(state, _ATTR, pipeline)
    return pipeline


def with_pipeline(lifespan: Callable[[Any], AbstractAsyncContextManager[None]],
                  state: ServerState) -> Callable[[Any], AbstractAsyncContextManager[None]]:
    """``lifespan``, with the tokenize pipeline started inside it (the backend attached) and stopped before it ends."""

    @asynccontextmanager
    async def run(app: Any) -> AsyncIterator[None]:
        async with lifespan(app):
            pipeline = pipeline_of(state)
            await pipeline.start()
            try:
                yield
            finally:
                await pipeline.stop()

    return run
