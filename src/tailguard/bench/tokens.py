"""Token counting on the bench side: the SmolLM2 tokenizer when it is available, else a labelled approximation.

The server's ``usage`` is the truth for what it billed; the local count is used to build prompts of a target length,
to recount outputs when ``usage`` is missing (the drift against ``usage`` is reported where both exist) and to
measure the per-language cost of tokenization (requirement L1).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from functools import lru_cache
from pathlib import Path

_APPROX_RE = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uf900-\ufaff\uac00-\ud7af]|\s*[A-Za-z]+|\s*\d|\s*[^\sA-Za-z\d]|\s+")
_CJK_RE = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uf900-\ufaff\uac00-\ud7af]")
_LATIN_RE = re.compile(r"[A-Za-z]")


class ApproxTokenizer:
    """A model-free stand-in: a Latin word, a digit, a CJK character or a punctuation mark is one token.

    Ids index a vocabulary built on the fly, so ``decode(encode(text)) == text``. Counts are approximate and every
    result that used it says so (``tokenizer: "approx"``).
    """

    name = "approx"

    def __init__(self) -> None:
        self._vocab: dict[str, int] = {}
        self._pieces: list[str] = []
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        out = []
        with self._lock:
            for piece in _APPROX_RE.findall(text):
                i = self._vocab.get(piece)
                if i is None:
                    i = self._vocab[piece] = len(self._pieces)
                    self._pieces.append(piece)
                out.append(i)
        return out

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return "".join(self._pieces[i] for i in ids)

    def encode_uncached(self, text: str) -> list[int]:
        return self.encode(text)


class GGUFTokenCounter:
    """The model's own tokenizer (byte-level BPE from a GGUF), without an encode cache, for honest timings.

    Parsing the GGUF's metadata takes seconds (tens on a busy machine), so the built tokenizer is saved once as a
    ``tokenizer.json`` under ``~/.cache/tailguard/bench`` (keyed by the file's size and mtime) and loaded from there.
    """

    def __init__(self, path, name: str) -> None:
        from tokenizers import Tokenizer

        self.name = name
        path = Path(path)
        st = path.stat()
        cache = _cache_dir() / f"{path.stem}-{st.st_size}-{int(st.st_mtime)}.tokenizer.json"
        if cache.is_file():
            self._tok = Tokenizer.from_file(str(cache))
            return
        from tailguard.engine.tokenizer import GGUFTokenizer

        self._tok = GGUFTokenizer(path, cache_size=0)._tok
        with contextlib.suppress(OSError):  # a read-only home only costs the next start its seconds
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            self._tok.save(str(tmp))
            os.replace(tmp, cache)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    encode_uncached = encode

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tailguard" / "bench"


@lru_cache(maxsize=4)
def load_tokenizer(spec: str = "auto"):
    """``auto``: SmolLM2 when its GGUF is in the local cache, else the approximation; ``approx``; a name or .gguf path."""
    if spec == "approx":
        return ApproxTokenizer()
    try:
        from tailguard.engine.model_store import resolve_model_path

        path = resolve_model_path("smollm2" if spec == "auto" else spec)
        return GGUFTokenCounter(path, "smollm2" if spec == "auto" else str(spec))
    except Exception:
        if spec != "auto":
            raise
        return ApproxTokenizer()


def language_of(text: str) -> str:
    """en, zh (CJK) or mixed, by the share of CJK characters among letters."""
    cjk = len(_CJK_RE.findall(text))
    latin = len(_LATIN_RE.findall(text))
    if cjk + latin == 0:
        return "other"
    share = cjk / (cjk + latin / 4.0)  # about four Latin letters per CJK character of content
    if share > 0.85:
        return "zh"
    if share < 0.15:
        return "en"
    return "mixed"


def tokenization_cost(tokenizer, texts_by_lang: dict[str, list[str]], repeats: int = 3) -> dict[str, dict]:
    """Requirement L1: what tokenizing a prompt costs, per language, measured here on the bench's own CPU.

    For each language: the median over prompts of (best of ``repeats``) encode time, and that time per 1,000
    characters and per 1,000 tokens, plus tokens per character. The ratio to English is added where English exists.
    """
    out: dict[str, dict] = {}
    for lang, texts in texts_by_lang.items():
        if not texts:
            continue
        per_req, per_kchar, per_ktok, tpc = [], [], [], []
        for text in texts:
            best = float("inf")
            n = 0
            for _ in range(repeats):
                t0 = time.perf_counter()
                n = len(tokenizer.encode_uncached(text))
                best = min(best, time.perf_counter() - t0)
            per_req.append(best)
            per_kchar.append(best / max(1, len(text)) * 1000)
            per_ktok.append(best / max(1, n) * 1000)
            tpc.append(n / max(1, len(text)))
        per_req.sort()
        per_kchar.sort()
        per_ktok.sort()
        tpc.sort()
        mid = len(per_req) // 2
        out[lang] = {
            "prompts": len(texts),
            "encode_us_per_request_p50": per_req[mid] * 1e6,
            "encode_us_per_request_max": per_req[-1] * 1e6,
            "encode_us_per_1k_chars": per_kchar[mid] * 1e6,
            "encode_us_per_1k_tokens": per_ktok[mid] * 1e6,
            "tokens_per_char": tpc[mid],
        }
    en = out.get("en")
    if en:
        for v in out.values():
            v["per_char_cost_vs_en"] = v["encode_us_per_1k_chars"] / en["encode_us_per_1k_chars"]
            v["per_token_cost_vs_en"] = v["encode_us_per_1k_tokens"] / en["encode_us_per_1k_tokens"]
    return {"tokenizer": getattr(tokenizer, "name", "?"), "by_language": out,
            "note": f"local encode on the bench machine, best of {repeats} per prompt; the server's own tokenize "
                    "stage (when joined) is in stages"}
