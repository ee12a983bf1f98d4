"""Structured output: a request's output held to a JSON schema, any JSON object, a regular expression or a grammar.

The library is llguidance, chosen by benchmarks/structured_output.py: xgrammar computes a mask in fewer microseconds
(median 2-3 us a token against 8, P99 15-19 against 80-86, at this 49,152-token vocabulary on 2 cores), but both are
well under 1% of a decode step here (~13 ms for one stream), and xgrammar imports torch and transformers (+237 MiB
resident, ~2 s), which the native runner exists to keep out of the serving process. llguidance is imported on the
first structured request, never before.

- ``GrammarCompiler`` (one per engine) builds llguidance's tokenizer from the engine's own GGUF tokenizer once, on
  first use, and compiles each distinct spec once (an LRU keyed by kind and spec text, failures included); a spec
  that does not compile is a ``RequestError`` at admission, for that request alone.
- ``GrammarMatcher`` (one per sequence, a cheap copy of the compiled template) gives the tokens allowed next as a
  boolean row over the vocabulary (sampling.py sets the rest to -inf before temperature, top-k, top-p or the greedy
  argmax), and is advanced with each sampled token in the engine's post-processing; when the grammar is complete
  (nothing but EOS could follow) the engine ends the request with finish_reason "stop". EOS is allowed only where
  the grammar accepts.

The mask is exact: every token whose bytes the grammar allows next is allowed, however it splits the text. llguidance
by default forces the canonical tokenization of any text the grammar fixes (a key, a literal) and allows that one token
alone; every grammar here sets its ``no_forcing`` option instead, so that greedy decoding under a grammar gives the
unconstrained greedy output wherever that output already fits (tests/engine/test_sampling_features.py), and the model keeps
its own tokenization.

JSON output is compact by default (``{"a": 1, "b": [2, 3]}``: json.dumps' separators, no free whitespace), so that a
small model cannot loop on newlines inside a document; a schema may override it with llguidance's own
``"x-guidance": {"whitespace_flexible": true}``.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tailguard.engine.sequence import RequestError

if TYPE_CHECKING:
    from tailguard.engine.tokenizer import GGUFTokenizer

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar")
MAX_SPEC_CHARS = 1 << 20  # 1 MiB of schema or grammar text
# JSON as json.dumps writes it: ", " between items, ": " after keys, no other whitespace.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DEFAULT_CACHE_ENTRIES = 128
# The compiled specs kept hold at most this many characters of spec text in all (a compiled grammar's memory grows
# with its spec: 128 specs of up to 1 MiB could hold gigabytes).
DEFAULT_CACHE_SPEC_CHARS = 8 << 20
# A grammar that grows past the grammar engine's limits as the output goes (a schema this large or this ambiguous):
# the request's own doing, so its error is the client's (a 400 at the API), not the service's. Engine errors carry
# this text (``is_grammar_limit``).
GRAMMAR_LIMIT_ERROR = "the structured output's grammar passed the grammar engine's limits"
# llguidance's words for its limits (max items in an Earley row, lexer fuel, lexer states, grammar size).
_LIMIT_MARKERS = ("max is", "fuel", "(limit", "too many", "too big")


def is_grammar_limit(message: str) -> bool:
    """Whether an engine error says that a request's grammar passed the grammar engine's limits."""
    return GRAMMAR_LIMIT_ERROR in message


def first_line(text: str, limit: int = 300) -> str:
    """The first line of a grammar engine's message (its later lines are parser state or a backtrace)."""
    return text.strip().split("\n", 1)[0][:limit]


def _matcher_failure(matcher: Any, what: str) -> ValueError:
    text = first_line(str(matcher.get_error()))
    if any(marker in text for marker in _LIMIT_MARKERS):
        return ValueError(f"{GRAMMAR_LIMIT_ERROR} ({text}); a smaller or less ambiguous schema or grammar avoids it")
    return ValueError(f"{what}: {text}")
# llguidance's grammar options (Lark syntax): let the model choose the tokenization of text the grammar fixes.
NO_FORCING = '%llguidance {"no_forcing": true}\n'


def _unforced(grammar: str) -> str:
    """An llguidance grammar (Lark text, or its JSON form) with every sub-grammar as Lark carrying the no_forcing
    option."""
    if not grammar.lstrip().startswith("{"):  # Lark text (what grammar_from_lark gives back)
        return NO_FORCING + grammar
    top = json.loads(grammar)
    for g in top.get("grammars", []):
        if g.get("lark_grammar"):
            g["lark_grammar"] = NO_FORCING + g["lark_grammar"]
        elif g.get("json_schema") is not None:
            g["lark_grammar"] = NO_FORCING + "start: %json " + json.dumps(g["json_schema"])
            g["json_schema"] = None
    return json.dumps(top)


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must be.

    kind: "json_schema" (spec: the schema as JSON text), "json_object" (any JSON object; spec unused), "regex" (spec:
    a regular expression, Rust regex syntax, matched against the whole output) or "grammar" (spec: a Lark grammar in
    llguidance's dialect, or a GBNF grammar as llama.cpp and xgrammar write them; told apart by ``::=``).
    """

    kind: str
    spec: str = ""

    def validate(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise RequestError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, not {self.kind!r}")
        if not isinstance(self.spec, str):
            raise RequestError("a structured output spec is text (a JSON schema as JSON, a regex, a grammar)")
        if self.kind != "json_object" and not self.spec.strip():
            raise RequestError(f"structured output of kind {self.kind} needs a spec")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise RequestError(f"a structured output spec may hold at most {MAX_SPEC_CHARS} characters")

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, "" if self.kind == "json_object" else self.spec)


class GrammarMatcher:
    """One sequence's position in its grammar: the tokens allowed next, and each sampled token taken."""

    __slots__ = ("_matcher", "_words", "_words_ptr", "vocab_size")

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self._words_ptr = self._words.ctypes.data  # the buffer lives as long as this matcher

    def allowed(self) -> np.ndarray:
        """A boolean row over the vocabulary: True where the token may come next (EOS only where the grammar
        accepts). A view of this matcher's own buffer, valid until the next call."""
        m = self._matcher
        if m.is_error():
            raise _matcher_failure(m, "grammar matcher failed")
        m.unsafe_compute_mask_ptr(self._words_ptr, self._words.nbytes)
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little", count=self.vocab_size)
        return bits.view(np.bool_)

    def allows(self, token_id: int) -> bool:
        """Whether the token may come next (one check, without the mask over the vocabulary)."""
        return bool(self._matcher.validate_tokens([token_id]) == 1)

    def advance(self, token_id: int) -> bool:
        """Take the sampled token; True once the grammar is complete (nothing but EOS may follow, or EOS came)."""
        m = self._matcher
        if not m.consume_token(token_id) or m.is_error():
            raise _matcher_failure(m, f"the grammar refused token {token_id}")
        return bool(m.is_stopped())

    @property
    def accepting(self) -> bool:
        return bool(self._matcher.is_accepting())


def _spec_chars(key: tuple[str, str]) -> int:
    return len(key[1] or "")


class GrammarCompiler:
    """Compiles specs against the engine's tokenizer, once per distinct spec; hands out a matcher per sequence.

    Thread-safe: AsyncLLMEngine compiles a request's spec on a worker thread before the request reaches the engine's
    thread (whose steps a compile would otherwise hold up), which then finds it in the cache."""

    def __init__(self, tokenizer: GGUFTokenizer, vocab_size: int, stop_ids: set[int],
                 cache_entries: int = DEFAULT_CACHE_ENTRIES, cache_spec_chars: int = DEFAULT_CACHE_SPEC_CHARS) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_ids = sorted(stop_ids)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()  # a template LLMatcher, or the error text
        self._cache_entries = cache_entries
        self._cache_spec_chars = cache_spec_chars
        self._cached_chars = 0  # spec characters of the entries kept
        self._lock = threading.Lock()  # the cache's; never held while compiling
        self._library_lock = threading.Lock()
        self._llg: Any = None
        self._lltok: Any = None
        self.compiles = 0  # specs compiled (cache misses), for tests and stats

    def _library(self) -> tuple[Any, Any]:
        """llguidance and its tokenizer over the engine's vocabulary (built on first use: ~0.3 s, once)."""
        with self._library_lock:
            if self._lltok is None:
                self._load_library()
        return self._llg, self._lltok

    def _load_library(self) -> None:
        try:
            import llguidance
        except ImportError as exc:  # an installation without it serves everything else
            raise RequestError("structured output needs the llguidance package, which is not installed") from exc
        # The engine's own tokenizers.Tokenizer (byte-level BPE from the GGUF, special tokens marked): llguidance reads
        # its vocabulary and never allows a special token other than EOS.
        self._lltok = llguidance.LLTokenizer(self._tokenizer._tok.to_str(), n_vocab=self.vocab_size,
                                             eos_token=self._stop_ids)
        self._llg = llguidance

    @staticmethod
    def _grammar(llg: Any, so: StructuredOutput) -> str:
        if so.kind == "json_object":
            grammar = llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_DEFAULTS)
        elif so.kind == "json_schema":
            try:
                schema = json.loads(so.spec)
            except ValueError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from exc
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema is a JSON object")
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        elif so.kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(so.spec)
        else:  # Lark or GBNF
            grammar = llg.grammar_from("grammar", so.spec)
        return _unforced(str(grammar))

    def _compile(self, so: StructuredOutput) -> Any:
        """The template matcher for a spec, or the error text that says why it does not compile."""
        llg, lltok = self._library()
        try:
            grammar = self._grammar(llg, so)
            matcher = llg.LLMatcher(lltok, grammar, log_level=0)
        except Exception as exc:  # noqa: BLE001 - any failure of a spec is that request's error
            return first_line(f"{exc}") or type(exc).__name__
        if matcher.is_error():
            return first_line(str(matcher.get_error()))
        # The first mask builds the lexer's states lazily (~2 ms for a nested schema); copies share what it built,
        # so each request's first mask costs what the others do.
        matcher.compute_bitmask()
        if matcher.is_error():
            return first_line(str(matcher.get_error()))
        return matcher

    def compiled(self, so: StructuredOutput) -> Any:
        """The spec's compiled template (from the cache, or compiled now, outside the cache's lock: two threads may
        both compile a new spec, never block each other); RequestError if it does not compile."""
        so.validate()
        key = so.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
        if compiled is None:
            compiled = self._compile(so)
            with self._lock:
                self.compiles += 1
                if key not in self._cache:
                    self._cached_chars += _spec_chars(key)
                self._cache[key] = compiled
                self._cache.move_to_end(key)
                # by count and by spec size, oldest first; the newest stays whatever its size
                while len(self._cache) > 1 and (len(self._cache) > self._cache_entries
                                                or self._cached_chars > self._cache_spec_chars):
                    old, _ = self._cache.popitem(last=False)
                    self._cached_chars -= _spec_chars(old)
        if isinstance(compiled, str):
            raise RequestError(f"the {so.kind} for structured output does not compile: {compiled}")
        return compiled

    def matcher(self, so: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher for one sequence; RequestError if the spec does not compile."""
        return GrammarMatcher(self.compiled(so).deep_copy(), self.vocab_size)
