"""The tokenizer and chat template, built from GGUF metadata with Hugging Face ``tokenizers`` (Rust BPE).

We build a byte-level BPE from the GGUF's vocabulary and merges. The pre-tokenizer splits digits one by one before
the GPT-2 byte-level split: that is what SmolLM2's own tokenizer.json does and what llama.cpp's ``smollm`` pre-tokenizer
does. (transformers' GGUF converter drops the digit split, so its ids differ on text with multi-digit numbers.)
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from threading import Lock
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from tailguard.engine.gguf_file import read_gguf

_CONTROL_TOKEN_TYPE = 3
DEFAULT_CACHE_BYTES = 64 * 1024 * 1024


def _cache_cost(text: str, ids: tuple[int, ...]) -> int:
    """Approximate bytes one cache entry holds: the key string, the id tuple and its int objects."""
    return sys.getsizeof(text) + sys.getsizeof(ids) + 28 * len(ids)

# Pre-tokenizer regexes known by llama.cpp's ``tokenizer.ggml.pre`` names; unknown names fall back to plain GPT-2.
_DIGIT_SPLITTING_PRE = {"smollm", "starcoder", "refact", "gpt2-digits"}


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


_BYTE_DECODER: dict[str, int] | None = None


def _byte_level_text(token: str) -> str:
    """A vocabulary entry (GPT-2 byte-level symbols) as the text it stands for; undecodable bytes as U+FFFD."""
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        # GPT-2's table: printable bytes stand for themselves, the others are shifted past U+0100.
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        codes, shift = list(printable), 0
        for b in range(256):
            if b not in printable:
                printable.append(b)
                codes.append(256 + shift)
                shift += 1
        _BYTE_DECODER = {chr(c): b for b, c in zip(printable, codes)}
    if any(ch not in _BYTE_DECODER for ch in token):
        return token  # an added (special) token is stored as its text
    return bytes(_BYTE_DECODER[ch] for ch in token).decode("utf-8", "replace")


# Texts longer than this are encoded through encode_batch, which releases the GIL (same ids, same speed).
_RELEASE_GIL_CHARS = 1024
# A glossary is encoded this many terms a batch: the Rust encodings of a whole big list at once would hold far more
# than its ids (offsets, masks, token strings) for every term together.
_GLOSSARY_CHUNK = 4096


@dataclass(frozen=True)
class GlossaryStats:
    terms: int  # pinned now
    bytes: int  # what their entries hold (approximately)
    dropped: int  # left out: past the byte budget
    tokens: int  # their ids, all together


class GGUFTokenizer:
    """Encode/decode plus the chat template; thread-safe, with an LRU cache of encodings.

    The cache is bounded by entries (``cache_size``) and by the bytes its keys and ids hold (``cache_bytes``): prompts
    reach 16 MB, so an entry count alone would let a few thousand of them hold gigabytes. An encoding larger than the
    whole budget is not cached. ``cache_size=0`` or ``cache_bytes=0`` turns the cache off.

    A glossary (``set_glossary``: a domain's terms) is pinned in front of the LRU, outside its bounds: traffic never
    evicts it. It only spares work: every id it holds is what ``encode`` gives for that text.
    """

    def __init__(self, path: str | Path, cache_size: int = 4096, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        # The lean reader: gguf.GGUFReader's per-token numpy arrays left ~40 MiB of fragmented heap behind.
        field = read_gguf(path).field

        model_type = field("tokenizer.ggml.model")
        if model_type != "gpt2":
            raise ValueError(f"unsupported tokenizer model {model_type!r}; only byte-level BPE (gpt2) is supported")
        tokens: list[str] = field("tokenizer.ggml.tokens")
        merges_raw: list[str] = field("tokenizer.ggml.merges")
        token_types: list[int] = field("tokenizer.ggml.token_type") or [1] * len(tokens)
        vocab = {tok: i for i, tok in enumerate(tokens)}
        merges = [(left, right) for left, right in (m.split(" ", 1) for m in merges_raw)]
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
        tok = Tokenizer(bpe)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        pre = str(field("tokenizer.ggml.pre", "gpt2"))
        if pre in _DIGIT_SPLITTING_PRE:
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, token_types) if ty == _CONTROL_TOKEN_TYPE]
        tok.add_special_tokens(specials)
        self._tok = tok
        self.vocab_size = len(tokens)
        self.special_ids = {vocab[t.content] for t in specials}
        self.bos_token_id = field("tokenizer.ggml.bos_token_id")
        self.eos_token_id = int(field("tokenizer.ggml.eos_token_id"))
        self.add_bos = bool(field("tokenizer.ggml.add_bos_token", False))
        self.chat_template_source = field("tokenizer.chat_template")
        self.tokens = tokens
        # No token spans more characters than its byte-level form has symbols (one a byte): with it, a prompt's
        # length in characters bounds its length in tokens from below before anything is tokenized.
        self.max_token_chars = max(len(t) for t in tokens)
        # And no token holds more than this many non-ASCII characters (SmolLM2: 8; Chinese text is ~1 a token),
        # nor more than one digit when digits are split: tighter floors for the texts where the first is loose.
        decoded = [_byte_level_text(t) for t in tokens]
        self.max_token_non_ascii = max(1, max(len(t) - len(t.encode("ascii", "ignore")) for t in decoded))
        self.max_token_digits = max(1, max(sum(c.isdigit() for c in t) for t in decoded))
        # ChatML models end a turn with <|im_end|>; generation stops there as well as at EOS.
        im_end = vocab.get("<|im_end|>")
        self.stop_token_ids = {self.eos_token_id} | ({im_end} if im_end is not None else set())
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=False)
        self._template = env.from_string(self.chat_template_source) if self.chat_template_source else None
        self._cache: OrderedDict[str, tuple[tuple[int, ...], int]] = OrderedDict()
        self._cache_size = cache_size
        self._cache_budget = cache_bytes
        self.cache_bytes = 0  # what the cache holds now
        self._lock = Lock()
        self.cache_hits = 0  # every hit, the glossary's included
        self.cache_misses = 0
        # A domain glossary's terms, pinned in front of the LRU (traffic never evicts them) and replaced as a whole
        # on reload: one dict swapped in, so a lookup needs no lock.
        self._glossary: dict[str, tuple[int, ...]] = {}
        self.glossary_bytes = 0
        self.glossary_hits = 0

    # --- encoding -------------------------------------------------------------------------------------------------
    def min_tokens(self, text: str) -> int:
        """A floor on the number of tokens ``text`` encodes to, in microseconds for any length (nothing is tokenized):
        its characters, its non-ASCII characters and its digits, each over the most of them one token can hold."""
        non_ascii = len(text) - len(text.encode("ascii", "ignore"))
        digits = sum(map(text.count, "0123456789")) if self.max_token_digits == 1 else 0
        return max(-(-len(text) // self.max_token_chars), -(-non_ascii // self.max_token_non_ascii), digits)

    def lookup(self, text: str) -> list[int] | None:
        """The ids of ``text`` when the glossary or the LRU cache holds them (a hit is counted), else None."""
        pinned = self._glossary.get(text)
        if pinned is not None:
            with self._lock:
                self.cache_hits += 1
                self.glossary_hits += 1
            return list(pinned)
        with self._lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                self.cache_hits += 1
                return list(hit[0])
        return None

    def encode(self, text: str) -> list[int]:
        hit = self.lookup(text)
        if hit is not None:
            return hit
        if len(text) > _RELEASE_GIL_CHARS:
            # encode_batch lets go of the GIL while Rust works (encode holds it: ~1 ms per 2,500 characters), so a
            # long prompt tokenized on a worker thread never stalls the event loop or the engine's thread.
            ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        self._store(text, ids)
        return ids

    def _store(self, text: str, ids: list[int]) -> None:
        with self._lock:
            self.cache_misses += 1
        if not (self._cache_size and self._cache_budget):
            return
        entry = tuple(ids)
        cost = _cache_cost(text, entry)
        if cost > self._cache_budget:
            return
        with self._lock:
            old = self._cache.pop(text, None)
            if old is not None:
                self.cache_bytes -= old[1]
            self._cache[text] = (entry, cost)
            self.cache_bytes += cost
            while len(self._cache) > self._cache_size or self.cache_bytes > self._cache_budget:
                _, (_, dropped) = self._cache.popitem(last=False)
                self.cache_bytes -= dropped

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts at once, past the cache; the Rust side runs them in parallel."""
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        prefix = [self.bos_token_id] if self.add_bos and self.bos_token_id is not None else []
        return [prefix + e.ids for e in encodings]

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``, with the cache's misses encoded together as one batch: Rust encodes them in
        parallel and without the GIL, so on a worker thread this never stalls the event loop. Same ids as ``encode``
        (the same tokenizer either way); a text that cannot be encoded raises for the whole call."""
        out: list[list[int] | None] = [self.lookup(t) for t in texts]
        misses = [i for i, ids in enumerate(out) if ids is None]
        if misses:
            # A text repeated within the batch is encoded once.
            unique = list(dict.fromkeys(texts[i] for i in misses))
            encoded = dict(zip(unique, self.encode_batch(unique)))
            for text, ids in encoded.items():
                self._store(text, ids)
            for i in misses:
                out[i] = list(encoded[texts[i]])
        return [ids for ids in out if ids is not None]

    # --- the glossary ---------------------------------------------------------------------------------------------
    def set_glossary(self, terms: Iterable[str], max_bytes: int = DEFAULT_CACHE_BYTES) -> GlossaryStats:
        """Pin ``terms`` (a domain's vocabulary: one term each) in front of the cache, pre-tokenized, in place of the
        glossary before. Tokenization does not change: a pinned entry holds exactly what ``encode`` gives. Terms past
        ``max_bytes`` of entries are left out (and counted). Slow for big lists: call it off the event loop."""
        unique = [t for t in dict.fromkeys(terms) if t]
        table: dict[str, tuple[int, ...]] = {}
        size = dropped = 0
        for start in range(0, len(unique), _GLOSSARY_CHUNK):
            chunk = unique[start:start + _GLOSSARY_CHUNK]
            for text, ids in zip(chunk, self.encode_batch(chunk)):
                entry = tuple(ids)
                cost = _cache_cost(text, entry)
                if size + cost > max_bytes:
                    dropped += 1
                    continue
                table[text] = entry
                size += cost
        # Terms now pinned would otherwise sit in the LRU twice.
        with self._lock:
            for text in table:
                old = self._cache.pop(text, None)
                if old is not None:
                    self.cache_bytes -= old[1]
            self._glossary = table
            self.glossary_bytes = size
        return GlossaryStats(terms=len(table), bytes=size, dropped=dropped,
                             tokens=sum(len(ids) for ids in table.values()))

    def cache_stats(self) -> dict[str, int]:
        """What the cache and the glossary hold and how often they answered."""
        with self._lock:
            return {"entries": len(self._cache), "bytes": self.cache_bytes, "hits": self.cache_hits,
                    "misses": self.cache_misses, "glossary_terms": len(self._glossary),
                    "glossary_bytes": self.glossary_bytes, "glossary_hits": self.glossary_hits}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    # --- chat -----------------------------------------------------------------------------------------------------
    def render_chat(self, messages: Sequence[Any], add_generation_prompt: bool = True) -> str:
        """``messages``: dicts with ``role`` and ``content`` (as the template takes them), or ChatMessages."""
        if self._template is None:
            raise ValueError("this model has no chat template; use the completions API")
        msgs = [m if isinstance(m, dict) else {"role": m.role, "content": m.content} for m in messages]
        return self._template.render(messages=msgs, add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages: list[dict] | list[ChatMessage]) -> list[int]:
        return self.encode(self.render_chat(messages))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, with ``tokenizers``' ``DecodeStream``.

    The stream keeps the short window of tokens it needs so that multi-token characters (common in Chinese, emoji)
    and byte-level merges decode correctly: a token that ends inside a UTF-8 sequence yields nothing until the
    sequence is complete. Special tokens (e.g. <|im_end|>) carry no visible text.
    """

    def __init__(self, tokenizer: GGUFTokenizer, prompt_tail: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self._stream = decoders.DecodeStream(skip_special_tokens=True)
        for token_id in prompt_tail or ():  # context only: its text is the prompt's, not ours
            self._stream.step(tokenizer._tok, token_id)
        self.num_tokens = 0
        self.text = ""

    def add(self, token_id: int) -> str:
        """Feed one token; returns the text it completes ("" while a character is still incomplete)."""
        self.num_tokens += 1
        delta = self._stream.step(self.tokenizer._tok, token_id)
        if not delta:
            return ""
        self.text += delta
        return delta
