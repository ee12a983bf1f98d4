"""User-facing text names things by what they are: no requirement codes, no private words.

Our requirement catalogue names capabilities with codes (a letter of L, O, S, T, C, E, M and a number: S3, L6, T4) and
talks of "the seed" (the field guide it was drawn from). Users never read it, so text they see says "the baseline SLO
profile", "tiered alerts", "the advisor's decision tree" instead. Checked here:

- every string literal in src/tailguard/**/*.py, f-strings' constant parts included: CLI output, log lines, HTTP
  errors, report HTML, alert texts, help and config descriptions. Docstrings are left out (like comments, they are
  read by whoever edits the code), except a module docstring the module itself uses (``description=__doc__``), and
  so are the patterns given to ``re`` (they find old wording to replace, and are never shown);
- the string values (not the keys) of the JSON files shipped in src/tailguard, and its other shipped .md files;
- README.md and docs/*.md, code blocks included.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tailguard"

# A catalogue code standing alone: P (P50, P99) is not a catalogue letter, and "E2E", "float16", "bf16" have no word
# boundary after the letter-digit pair, so none of them match.
CODE = re.compile(r"\b[CELMOST][0-9]{1,2}\b")
PRIVATE = re.compile(
    r"\bseed's\b"  # the seed document's figures, rules, tree...
    r"|\bthe seed\b"  # the document itself ("the seed: 16", "the seed claims"); a random seed is "the random seed"
    r"|\boptimi[sz]ation plan\b"  # "start the optimization plan now"
    r"|\bimprovement plan\b",  # "make an improvement plan within 24 h"
    re.IGNORECASE,
)

# Justified look-alikes, as narrow as they can be: (file, or "*" for any, pattern, why). Each match is blanked out
# before the codes are looked for.
EXCEPTIONS: list[tuple[str, str, str]] = [
    ("*", r"-O[0-3]\b", "a compiler's optimization level (gcc -O3)"),
    ("*", r"\bL[12] norm\b", "the vector norm"),
    ("docs/benchmarks.md", r"\b(?:in|into) L1\b(?= while)", "the CPU's first-level cache"),
    ("docs/benchmarks.md", r"\bboth operands in L1\b", "the CPU's first-level cache"),
    ("docs/benchmarks.md", r"\bMiB (?:of )?L3\b", "the CPU's third-level cache"),
    ("docs/benchmarks.md", r"\b(?:fits in|model from) L3\b", "the CPU's third-level cache"),
]


def _offences(rel: str, text: str) -> list[str]:
    """What in ``text`` a user should not read: the codes and private phrases found, in order."""
    for where, pattern, _why in EXCEPTIONS:
        if where in ("*", rel):
            text = re.sub(pattern, lambda m: " " * len(m.group(0)), text)
    found = [(m.start(), m.group(0)) for m in CODE.finditer(text)]
    found += [(m.start(), m.group(0)) for m in PRIVATE.finditer(text)]
    return [s for _pos, s in sorted(found)]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the docstring nodes, less the module's when the module reads its own ``__doc__`` (then users see it)."""
    uses_doc = any(isinstance(n, ast.Name) and n.id == "__doc__" for n in ast.walk(tree))
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if isinstance(node, ast.Module) and uses_doc:
            continue
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            out.add(id(body[0].value))
    return out


_RE_FUNCS = {"compile", "search", "match", "fullmatch", "sub", "subn", "findall", "finditer", "split"}


def _regex_patterns(tree: ast.Module) -> set[int]:
    """ids of the string literals passed as the pattern of ``re.compile(...)``, ``re.sub(...)`` and the like."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _RE_FUNCS \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "re" and node.args:
            out.add(id(node.args[0]))
    return out


def _line_of(lines: list[str], first: int, last: int, needle: str) -> int:
    """The line in [first, last] (1-based) that holds ``needle``; ``first`` when it straddles a line break."""
    for no in range(first, last + 1):
        if needle in lines[no - 1]:
            return no
    return first


def python_offences(rel: str, source: str) -> list[str]:
    lines = source.splitlines()
    tree = ast.parse(source, filename=rel)
    skip = _docstrings(tree) | _regex_patterns(tree)
    out = []
    # Constants inside an f-string may carry the f-string's position (3.11) or their own: search the outer span.
    span: dict[int, tuple[int, int]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            for part in node.values:
                span[id(part)] = (node.lineno, node.end_lineno or node.lineno)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in skip:
            continue
        first, last = span.get(id(node), (node.lineno, node.end_lineno or node.lineno))
        for bad in _offences(rel, node.value):
            # The source line of the phrase; a phrase cut by a line break is reported at the string's first line.
            ctx = re.search(rf".{{0,30}}{re.escape(bad)}.{{0,30}}", node.value, re.DOTALL)
            snippet = " ".join((ctx.group(0) if ctx else bad).split())
            out.append(f"{rel}:{_line_of(lines, first, last, bad)}: {bad!r} in {snippet!r}")
    return out


def _json_strings(value, path: str = ""):
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _json_strings(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _json_strings(v, f"{path}[{i}]")


def json_offences(path: Path) -> list[str]:
    raw = path.read_text(encoding="utf-8")
    rel = _rel(path)
    out = []
    for where, value in _json_strings(json.loads(raw)):
        for bad in _offences(rel, value):
            at = raw.find(json.dumps(value, ensure_ascii=False)[1:-1][:80])
            line = raw.count("\n", 0, at) + 1 if at >= 0 else 0
            out.append(f"{rel}:{line}: {bad!r} in {where}")
    return out


def text_offences(path: Path) -> list[str]:
    rel = _rel(path)
    out = []
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        out += [f"{rel}:{no}: {bad!r} in {line.strip()[:120]!r}" for bad in _offences(rel, line)]
    return out


def _report(offences: list[str]) -> str:
    return f"{len(offences)} catalogue codes or private words in user-facing text:\n" + "\n".join(offences)


def test_python_string_literals():
    offences = [o for p in sorted(SRC.rglob("*.py")) for o in python_offences(_rel(p), p.read_text("utf-8"))]
    assert not offences, _report(offences)


def test_shipped_data_files():
    offences = [o for p in sorted(SRC.rglob("*.json")) for o in json_offences(p)]
    offences += [o for p in sorted(SRC.rglob("*.md")) for o in text_offences(p)]
    assert not offences, _report(offences)


def test_docs_and_readme():
    offences = [o for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))] for o in text_offences(p)]
    assert not offences, _report(offences)


@pytest.mark.parametrize(("text", "found"), [
    ("P99 over the yellow threshold (S3)", ["S3"]),
    ("requirements L1-L6, T4/M2 and E2", ["L1", "L6", "T4", "M2", "E2"]),
    ("the seed's baseline", ["the seed"]),
    ("(seed's golden rule)", ["seed's"]),
    ("The seed: 16", ["The seed"]),
    ("start the optimization plan now; make an improvement plan", ["optimization plan", "improvement plan"]),
    ("E2E P50 <= 450 ms, P95, P99, float16 and bf16 KV, the L2 norm, gcc -O3", []),
    ("rerun with the same seed; --seed 7; seeded runs", []),
    ("S10 and O12 are codes too, but not S3a or xT4", ["S10", "O12"]),
])
def test_detector(text, found):
    assert _offences("src/tailguard/x.py", text) == found


PROBE = """\
\"\"\"Module docstring (S3).\"\"\"
import re


def f(n):
    \"\"\"The seed's rule (L4).\"\"\"
    re.compile(r"the seed's tree")
    return f"{n} requests (T4)"
"""


def test_docstrings_and_regex_patterns_are_left_out_fstring_text_is_not():
    assert python_offences("x.py", PROBE) == ["x.py:8: 'T4' in 'requests (T4)'"]
    used = PROBE.replace("import re", "import re\nHELP = __doc__")  # the module shows its docstring
    assert python_offences("x.py", used) == ["x.py:1: 'S3' in 'Module docstring (S3).'",
                                             "x.py:9: 'T4' in 'requests (T4)'"]


def test_cache_levels_are_allowed_only_where_listed():
    line = "260 MiB of L3, so the weights stay in L1 while"
    assert _offences("docs/benchmarks.md", line) == []
    assert _offences("docs/slo.md", line) == ["L3", "L1"]
