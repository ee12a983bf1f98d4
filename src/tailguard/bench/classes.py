"""Traffic classes: one bench run mixing several kinds of callers, each judged on its own.

A class has a name, an API key (sent as ``Authorization: Bearer <key>``), a share of the arrivals (or its requests
are named by a column of a replayed trace), its own prompt and output lengths, and its own SLO profiles. Say
``vip`` 10% under a strict profile, ``standard`` 60%, ``batch`` 30% under a loose one: the run then reports
percentiles, goodput and verdicts per class and for the whole, and ``compare --gate`` gates each class.

Classes come from repeatable ``--class name=vip,share=0.1,key=sk-vip,profile=strict,prompt-tokens=128`` flags or
from a YAML/JSON file (``--classes FILE``), both read into :class:`TrafficClass`.

Each arrival's class is drawn from its index and the run's seed alone (not from a shared random stream), so two
runs of one schedule send the same class to the same arrival, whatever else differs between them.
"""

from __future__ import annotations

import bisect
import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tailguard.bench.workloads import LANGS, RequestSpec

__all__ = [
    "ClassedWorkload",
    "analyse_classes",
    "TrafficClass",
    "assign_index",
    "class_secrets",
    "classes_from_file",
    "classes_from_specs",
    "describe_classes",
    "parse_class_spec",
    "resolve_profiles",
    "settle_shares",
]

# The fields a class may set, in the order help and errors list them (the flag's spelling, with dashes).
FIELDS = ("name", "share", "key", "key-env", "profile", "prompt-tokens", "output-tokens", "input-spread",
          "output-spread", "langs", "business-type", "header")
# Other spellings people type (GuideLLM, vLLM bench and AIPerf say prompt/input and output tokens).
_ALIASES = {"input_tokens": "prompt_tokens", "api_key": "key", "profiles": "profile", "lang": "langs",
            "weight": "share", "headers": "header"}
SHARE_TOLERANCE = 1e-3  # 0.1 + 0.6 + 0.3 is not exactly 1 in floating point; a typo is further off than this


class TrafficClass(BaseModel):
    """One class of traffic. ``profile``: SLO profile names (built in, or defined in a --profiles-file) or YAML
    paths; empty: the run's own profiles. Unset lengths are the run's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    share: float | None = Field(default=None, gt=0, le=1)
    key: str | None = Field(default=None, min_length=1)
    key_env: str | None = Field(default=None, min_length=1)
    profile: tuple[str, ...] = ()
    prompt_tokens: int | None = Field(default=None, ge=1)
    output_tokens: int | None = Field(default=None, ge=1)
    input_spread: float | None = Field(default=None, ge=0, lt=1)
    output_spread: float | None = Field(default=None, ge=0, lt=1)
    langs: tuple[str, ...] = ()
    business_type: str | None = None
    header: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _spellings(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        out: dict[str, Any] = {}
        for k, v in data.items():
            key = str(k).strip().lower().replace("-", "_")
            key = _ALIASES.get(key, key)
            if key in out:
                raise ValueError(f"{k!r} given twice")
            out[key] = v
        return out

    @field_validator("share", mode="before")
    @classmethod
    def _percent(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip().endswith("%"):
            try:
                return float(v.strip()[:-1]) / 100
            except ValueError:
                raise ValueError(f"not a share: {v!r} (use e.g. 0.1 or 10%)") from None
        return v

    @field_validator("profile", "langs", mode="before")
    @classmethod
    def _listing(cls, v: Any) -> Any:
        if isinstance(v, str):  # "strict+finance" on the command line, "en,zh" in a file
            return tuple(x.strip() for x in re.split(r"[+,]", v) if x.strip())
        return v

    @field_validator("langs")
    @classmethod
    def _known_langs(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [x for x in v if x not in LANGS]
        if bad:
            raise ValueError(f"unknown language {bad[0]!r}; choose from {', '.join(LANGS)}")
        return v

    @field_validator("header", mode="before")
    @classmethod
    def _headers(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [v]
        if isinstance(v, list | tuple):
            out = {}
            for h in v:
                name, sep, value = str(h).partition(":")
                if not sep or not name.strip():
                    raise ValueError(f"a header is NAME:VALUE, got {h!r}")
                out[name.strip()] = value.strip()
            return out
        return v

    @model_validator(mode="after")
    def _one_key(self) -> TrafficClass:
        if self.key and self.key_env:
            raise ValueError("give key or key-env, not both")
        return self

    @property
    def own_prompts(self) -> bool:
        """Whether the class's prompts differ from the run's workload (then it gets synthetic ones of its own)."""
        return self.prompt_tokens is not None or self.input_spread is not None or bool(self.langs)

    def api_key(self) -> str | None:
        if self.key_env:
            return os.environ.get(self.key_env) or None
        return self.key

    def workload_overrides(self) -> dict[str, Any]:
        return {k: v for k, v in (("prompt_tokens", self.prompt_tokens), ("output_tokens", self.output_tokens),
                                  ("input_spread", self.input_spread), ("output_spread", self.output_spread),
                                  ("langs", list(self.langs) or None), ("business_type", self.business_type))
                if v is not None}


class ClassesFile(BaseModel):
    """``classes.yaml``: ``classes: [...]`` (or a bare list), and optionally the trace column naming the class."""

    model_config = ConfigDict(extra="forbid")

    classes: list[TrafficClass] = Field(min_length=1)
    column: str | None = None


def _errors(exc: ValidationError, where: str, names: Sequence[str] = ()) -> str:
    """pydantic's errors as one line: ``class 'vip': share: input should be greater than 0 (got -1)``."""
    parts = []
    for err in exc.errors():
        loc = list(err["loc"])
        prefix = where
        if len(loc) >= 2 and loc[0] == "classes" and isinstance(loc[1], int):
            i = loc[1]
            which = f"class {names[i]!r}" if i < len(names) and names[i] else f"classes[{i}]"
            prefix = f"{where}: {which}" if where else which
            loc = loc[2:]
        field_name = ".".join(str(x) for x in loc).replace("_", "-")
        if err["type"] == "extra_forbidden":
            msg = f"unknown field {field_name!r} (known: {', '.join(FIELDS)})"
            field_name = ""
        else:
            msg = err["msg"].removeprefix("Value error, ")
            msg = msg[:1].lower() + msg[1:]
            if err["type"] not in ("missing", "value_error") and "input" in err:
                msg += f" (got {err['input']!r})"
            if err["type"] == "string_pattern_mismatch" and loc == ["name"]:
                msg = f"a class name is letters, digits, '_', '.' or '-' (got {err.get('input')!r})"
        parts.append(": ".join(x for x in (prefix, field_name, msg) if x))
    return "; ".join(parts)


def parse_class_spec(text: str) -> dict[str, Any]:
    """``name=vip,share=0.1,key=sk-vip,profile=strict,header=X-Lane:core`` -> a dict (``header`` may repeat)."""
    out: dict[str, Any] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        k, sep, v = part.partition("=")
        k = k.strip().lower()
        if not sep or not k:
            raise ValueError(f"--class wants FIELD=VALUE pairs separated by commas, got {part.strip()!r} "
                             f"(fields: {', '.join(FIELDS)})")
        if k.replace("-", "_") in ("header", "headers"):
            out.setdefault("header", []).append(v.strip())
            continue
        if k in out:
            raise ValueError(f"--class {k!r} given twice in {text!r}")
        out[k] = v.strip()
    return out


def classes_from_specs(specs: Sequence[str]) -> list[TrafficClass]:
    """``--class`` flags into classes; a ValueError says which flag and which field is wrong."""
    out = []
    for text in specs:
        d = parse_class_spec(text)
        try:
            out.append(TrafficClass.model_validate(d))
        except ValidationError as exc:
            label = f"class {d['name']!r}" if d.get("name") else f"--class {text!r}"
            raise ValueError(_errors(exc, label)) from None
    _unique(out)
    return out


def classes_from_file(path: str | Path) -> tuple[list[TrafficClass], str | None]:
    """(classes, trace column) from a YAML or JSON file."""
    import yaml

    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text(encoding="utf-8"))  # JSON is YAML too
    except OSError as exc:
        raise ValueError(f"--classes: cannot read {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        raise ValueError(f"--classes {path}: not YAML or JSON ({where}{problem or str(exc).splitlines()[0]})") from None
    if isinstance(doc, list):
        doc = {"classes": doc}
    if not isinstance(doc, dict):
        raise ValueError(f"--classes {path}: expected 'classes:' with a list of classes")
    raw = doc.get("classes")
    names = [str(c.get("name", "")) if isinstance(c, dict) else "" for c in raw] if isinstance(raw, list) else []
    try:
        f = ClassesFile.model_validate(doc)
    except ValidationError as exc:
        raise ValueError(_errors(exc, f"--classes {path}", names)) from None
    _unique(f.classes)
    return f.classes, f.column


def _unique(classes: Sequence[TrafficClass]) -> None:
    seen: set[str] = set()
    for c in classes:
        if c.name in seen:
            raise ValueError(f"two classes are named {c.name!r}: each class needs its own name")
        seen.add(c.name)


def settle_shares(classes: Sequence[TrafficClass], by_column: bool = False) -> list[TrafficClass]:
    """Shares that add up to 1: at most one class may leave its share out and take the rest. With ``by_column``
    (a trace names each request's class) shares are not needed and are left as given."""
    if by_column:
        return list(classes)
    missing = [c for c in classes if c.share is None]
    total = sum(c.share or 0.0 for c in classes)
    listing = ", ".join(f"{c.name} {c.share:g}" for c in classes if c.share is not None)
    if len(missing) > 1:
        raise ValueError("at most one class may leave its share out (it takes the rest); "
                         f"{', '.join(c.name for c in missing)} have none")
    if missing:
        rest = 1.0 - total
        if rest <= SHARE_TOLERANCE:
            raise ValueError(f"the shares given already add up to {total:g} ({listing}): nothing is left for "
                             f"class {missing[0].name!r}")
        # rounded: 1 - 0.1 - 0.6 reads 0.30000000000000004 otherwise
        return [c.model_copy(update={"share": round(rest, 9)}) if c.share is None else c for c in classes]
    if abs(total - 1.0) > SHARE_TOLERANCE:
        raise ValueError(f"class shares must add up to 1, got {total:g} ({listing})")
    return [c.model_copy(update={"share": round((c.share or 0.0) / total, 9)}) for c in classes]


def assign_index(i: int, seed: int, cumulative: Sequence[float]) -> int:
    """The class (its position) of arrival ``i``: a pure function of (seed, i, shares), so A/B runs of one schedule
    agree arrival by arrival, and adding requests to a run leaves the classes of the earlier ones alone."""
    u = random.Random(f"class:{seed}:{i}").random()
    return min(bisect.bisect_right(cumulative, u), len(cumulative) - 1)


def resolve_profiles(names: Sequence[str], run_profiles: Sequence[Any]) -> list[Any]:
    """A class's profiles: a profile the run loaded (a built-in or one from --profiles-file) by its name first, then a
    built-in name or a YAML path."""
    from tailguard.bench.profiles import load_profiles

    by_name = {p.name: p for p in run_profiles}
    out = []
    for n in names:
        out.extend([by_name[n]] if n in by_name else load_profiles([n]))
    return out


def class_secrets(classes: Sequence[TrafficClass]) -> list[str]:
    """Every class's credentials (its key, credential header values): they must appear in no output."""
    from tailguard.bench.redact import secret_values

    out: set[str] = set()
    for c in classes:
        # the key alone, as with --api-key, so that an echoed "Bearer <key>" reads "Bearer ***"
        out.update(secret_values(c.api_key(), c.header, None))
    return sorted(out, key=len, reverse=True)


def describe_classes(classes: Sequence[TrafficClass]) -> list[dict[str, Any]]:
    """The class definitions for results.json: no key and no credential header value, only whether one was set."""
    from tailguard.bench.redact import MASK, secret_header

    out = []
    for c in classes:
        out.append({"name": c.name, "share": c.share, "profiles": list(c.profile),
                    "key": MASK if c.api_key() else None, "key_env": c.key_env,
                    "workload": c.workload_overrides(),
                    "headers": {k: (MASK if secret_header(k) else v) for k, v in c.header.items()}})
    return out


# --- the workload -----------------------------------------------------------------------------------------------

@dataclass
class ClassedWorkload:
    """The run's workload with each request's class: its share (seeded by the index) or a trace's column, its own
    prompt and output lengths where it sets them, and its headers (the API key among them)."""

    base: Any
    classes: list[TrafficClass]
    seed: int = 0
    by_column: bool = False  # the trace's rows name their class (``base.class_of``)
    own: dict[str, Any] = field(default_factory=dict)  # class name -> its own synthetic workload
    _cum: list[float] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.classes = settle_shares(self.classes, self.by_column)
        self._by_name = {c.name: c for c in self.classes}
        acc = 0.0
        for c in self.classes:
            acc += c.share or 0.0
            self._cum.append(acc)
        if self._cum:
            self._cum[-1] = 1.0  # rounding must never leave a gap above the last class

    @property
    def name(self) -> str:
        return f"{self.base.name} in {len(self.classes)} classes"

    def __len__(self) -> int:
        return len(self.base)

    def __getattr__(self, item: str) -> Any:  # offsets(), trace_rate(), rows, speedup, ...: the base's
        if item.startswith("_") or item in ("base", "classes", "own"):
            raise AttributeError(item)
        return getattr(self.base, item)

    def class_of(self, i: int) -> TrafficClass:
        if self.by_column:
            return self._by_name[self.base.class_of(i)]
        return self.classes[assign_index(i, self.seed, self._cum)]

    def describe(self) -> dict:
        d = dict(self.base.describe())
        d["classes"] = describe_classes(self.classes)
        return d

    def spec(self, i: int) -> RequestSpec:
        c = self.class_of(i)
        own = self.own.get(c.name)
        spec = (own or self.base).spec(i)
        if own is None and c.output_tokens is not None:
            # the run's prompt with the class's output length (spread with the class's own seeded draw)
            rng = random.Random(f"class-out:{self.seed}:{i}")
            spread = c.output_spread or 0.0
            spec.max_tokens = max(1, round(c.output_tokens * (1 + rng.uniform(-spread, spread)))) if spread else \
                c.output_tokens
        if c.business_type:
            spec.business_type = c.business_type
        spec.traffic_class = c.name
        return spec

    def headers_by_class(self) -> dict[str, dict[str, str]]:
        """What each class adds to its requests' headers: its own ones, then its key as a bearer token."""
        out: dict[str, dict[str, str]] = {}
        for c in self.classes:
            h = dict(c.header)
            key = c.api_key()
            if key:
                h = {k: v for k, v in h.items() if k.lower() != "authorization"}
                h["Authorization"] = f"Bearer {key}"
            if h:
                out[c.name] = h
        return out


# --- the analysis -----------------------------------------------------------------------------------------------

CLASS_METRICS = ("ttft", "itl", "tpot", "e2e")


def analyse_classes(classes: Sequence[TrafficClass], measured: Sequence[Any], run_profiles: Sequence[Any],
                    whole_slo: dict, window: float, reps: int, seed: int, failures_at: float | None,
                    by_column: bool = False, column: str | None = None) -> dict:
    """Per class: its requests, percentiles with CIs, throughput and goodput over the run's window, and the verdicts
    of its own profiles (the run's when it names none); and the whole run's verdict beside them."""
    from tailguard.bench.metrics import aggregate
    from tailguard.bench.profiles import evaluate

    total = len(measured)
    by_class: dict[str, dict] = {}
    for c in classes:
        rows = [m for m in measured if m.traffic_class == c.name]
        agg = aggregate(rows, reps=reps, seed=seed, failures_at=failures_at, rate_window=window)
        profiles = resolve_profiles(c.profile, run_profiles) if c.profile else list(run_profiles)
        slo = {p.name: evaluate(p, agg.measured, window, reps, seed, shared=agg.metrics) for p in profiles}
        judged = [v for v in slo.values() if v.get("evaluated")]
        s = agg.summary
        by_class[c.name] = {
            "share_planned": None if by_column else c.share,
            "share_sent": len(rows) / total if total else None,
            "requests": s["requests"],
            "error_rate": s["error_rate"],
            "throughput": s["throughput"],
            "errors_by_kind": s["errors_by_kind"],
            "percentile_failures": s["percentile_failures"],
            "metrics": {k: agg.metrics[k] for k in CLASS_METRICS},
            "profiles": [p.name for p in profiles],
            "profiles_from": "class" if c.profile else "run",
            "slo": slo,
            "pass": all(v["pass"] for v in judged) if judged else None,
            "goodput_rps": {name: v.get("goodput_rps") for name, v in slo.items()},
        }
    judged = [v for v in whole_slo.values() if v.get("evaluated")]
    return {
        "assignment": "column" if by_column else "share",
        "column": column if by_column else None,
        "note": (f"each request's class is the trace's {column!r} column" if by_column else
                 "each arrival's class is drawn from its index and the random seed (--seed), with the classes' "
                 "shares as probabilities: runs of one schedule and seed send the same class to the same arrival"),
        "definitions": describe_classes(classes),
        "by_class": by_class,
        "whole": {"profiles": list(whole_slo), "pass": all(v["pass"] for v in judged) if judged else None,
                  "requests": total},
    }
