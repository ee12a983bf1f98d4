"""SLO profiles: named sets of objectives over latency metrics.

A profile is a list of :class:`Objective`. Each objective names a metric (``ttft``, ``e2e``...), a percentile (or
none for rate metrics), a threshold in seconds (latencies) or as a ratio (rates, decay), and optionally a ``where``
selector that narrows the traffic it applies to (a lane, a client class, long-context requests, peak hours).

The required profiles are built in (:data:`BUILTIN_PROFILES`): ``baseline``, ``advanced`` (baseline plus the
advanced objectives), ``strict`` (advanced plus both strict scenarios), ``strict-finance`` and ``strict-medical``.
Custom profiles come from YAML through :func:`load_profiles`; they may extend a built-in one.

This is the one profile model of tailguard: the live monitor judges it over its windows, and ``tailguard bench``
judges it over a run (:mod:`tailguard.bench.profiles`). Two fields matter to the bench only: an objective's
``all_if_unlabelled`` and a profile's ``request_bounds`` (the per-request bounds that define goodput).

YAML shape::

    profiles:
      chat-gold:
        description: premium chat
        extends: baseline            # optional: start from these objectives
        applies_to: {business_types: [chat], lanes: [vip]}
        objectives:
          - {metric: ttft, percentile: 95, threshold: 0.25}
          - {metric: e2e, percentile: 99, threshold: "1.5s"}
          - {metric: error_rate, threshold: "0.5%"}
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "BUILTIN_PROFILES",
    "LATENCY_METRICS",
    "RATE_METRICS",
    "Metric",
    "Objective",
    "ProfileError",
    "RequestBound",
    "Selector",
    "SLOProfile",
    "builtin_profiles",
    "get_profile",
    "load_profiles",
    "parse_profiles",
    "profile_names",
]


class Metric(StrEnum):
    """What an objective measures. Definitions follow docs/metrics.md (vLLM's)."""

    TTFT = "ttft"  # arrival -> first content token leaves the server
    ITL = "itl"  # each gap between consecutive tokens
    TPOT = "tpot"  # (e2e - ttft) / (output tokens - 1), per request
    E2E = "e2e"  # arrival -> last byte
    E2E_PER_TOKEN = "e2e_per_token"  # e2e / output tokens, per request: E2E that does not grow with the answer
    QUEUE_WAIT = "queue_wait"  # admitted -> first scheduled
    TOKENIZE = "tokenize"
    PREFILL = "prefill"
    ERROR_RATE = "error_rate"  # failed / all requests in the window
    DEGRADATION_RATE = "degradation_rate"  # degraded answers / all requests in the window
    SHED_RATE = "shed_rate"  # refused (429/503) / all requests in the window
    INTERRUPTION_RATE = "interruption_rate"  # streams ended without [DONE] / streams that began, in the window
    LONG_CONTEXT_DECAY = "long_context_decay"  # P(long) / P(short) - 1, e2e by default


LATENCY_METRICS: frozenset[Metric] = frozenset(
    {Metric.TTFT, Metric.ITL, Metric.TPOT, Metric.E2E, Metric.E2E_PER_TOKEN, Metric.QUEUE_WAIT, Metric.TOKENIZE,
     Metric.PREFILL}
)
RATE_METRICS: frozenset[Metric] = frozenset(
    {Metric.ERROR_RATE, Metric.DEGRADATION_RATE, Metric.SHED_RATE, Metric.INTERRUPTION_RATE})


class ProfileError(ValueError):
    """A profile file or definition is invalid. The message lists every problem with its location."""


_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|us|s|m|%)?\s*$")
_UNITS = {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "%": 0.01}


def _parse_quantity(value: Any) -> Any:
    """``"350ms"`` -> 0.35, ``"2s"`` -> 2.0, ``"0.5%"`` -> 0.005; numbers pass through; anything else is left to
    pydantic so that its error message names the field."""
    if isinstance(value, str):
        m = _DURATION.match(value)
        if not m:
            raise ValueError(f"cannot read {value!r} as a number, a duration (350ms, 2s) or a percentage (0.5%)")
        return float(m.group(1)) * _UNITS[m.group(2)]
    return value


class Selector(BaseModel):
    """Narrows the traffic an objective (or a profile) applies to. Empty fields match everything."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # figures end up in arithmetic

    business_types: tuple[str, ...] = ()
    lanes: tuple[str, ...] = ()
    # Lanes left out (the default scope leaves out the non-core lanes, whose requests wait by design).
    not_lanes: tuple[str, ...] = ()
    clients: tuple[str, ...] = ()  # client class, e.g. "mobile", "web"
    regions: tuple[str, ...] = ()
    min_input_tokens: int | None = Field(default=None, ge=0)
    max_input_tokens: int | None = Field(default=None, ge=0)
    peak_only: bool = False

    @field_validator("business_types", "lanes", "not_lanes", "clients", "regions", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return (v,) if isinstance(v, str) else v

    @model_validator(mode="after")
    def _range(self) -> Selector:
        if (
            self.min_input_tokens is not None
            and self.max_input_tokens is not None
            and self.min_input_tokens > self.max_input_tokens
        ):
            raise ValueError("min_input_tokens is greater than max_input_tokens")
        return self

    @property
    def is_empty(self) -> bool:
        return self == Selector()

    def matches(
        self,
        *,
        business_type: str | None = None,
        lane: str | None = None,
        client: str | None = None,
        region: str | None = None,
        input_tokens: int | None = None,
        peak: bool = False,
    ) -> bool:
        if self.business_types and business_type not in self.business_types:
            return False
        if self.lanes and lane not in self.lanes:
            return False
        if lane in self.not_lanes:
            return False
        if self.clients and client not in self.clients:
            return False
        if self.regions and region not in self.regions:
            return False
        if self.min_input_tokens is not None and (input_tokens is None or input_tokens < self.min_input_tokens):
            return False
        if self.max_input_tokens is not None and (input_tokens is None or input_tokens > self.max_input_tokens):
            return False
        return not (self.peak_only and not peak)


class Objective(BaseModel):
    """One target: ``metric`` at ``percentile`` must be ``comparison`` ``threshold``.

    Latency thresholds are seconds; rate thresholds and ``long_context_decay`` are ratios (0.005 = 0.5%, 0.4 = 40%).
    Strings with units are accepted: ``"350ms"``, ``"2s"``, ``"0.5%"``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # figures end up in arithmetic

    metric: Metric
    percentile: float | None = Field(default=None, gt=0, lt=100)
    threshold: float = Field(ge=0)
    comparison: Literal["<=", "<"] = "<="
    where: Selector = Selector()
    # long_context_decay only: which latency is compared, and what counts as long and short context.
    of: Metric = Metric.E2E
    long_min_tokens: int = Field(default=65536, ge=1)
    short_max_tokens: int = Field(default=8192, ge=1)
    name: str | None = None
    description: str = ""
    # Bench only: a run in which no request has a business type is held to this objective as a whole (the
    # finance bound, say, for a run that is all finance Q&A but not labelled so). The live monitor ignores it.
    all_if_unlabelled: bool = False

    @field_validator("threshold", mode="before")
    @classmethod
    def _quantity(cls, v: Any) -> Any:
        return _parse_quantity(v)

    @field_validator("percentile", mode="before")
    @classmethod
    def _pct(cls, v: Any) -> Any:
        if isinstance(v, str):  # "p99", "P99", "99.9"
            s = v.strip().lower().removeprefix("p")
            try:
                return float(s)
            except ValueError:
                raise ValueError(f"cannot read {v!r} as a percentile (write 99 or p99)") from None
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Objective:
        if self.metric in LATENCY_METRICS and self.percentile is None:
            raise ValueError(f"metric {self.metric.value!r} is a latency: give a percentile (e.g. percentile: 99)")
        if self.metric in RATE_METRICS:
            if self.percentile is not None:
                raise ValueError(f"metric {self.metric.value!r} is a rate: it takes no percentile")
            if self.threshold > 1:
                raise ValueError(
                    f"metric {self.metric.value!r} is a rate between 0 and 1; got {self.threshold} "
                    "(write 0.005 or '0.5%')"
                )
        if self.metric is Metric.LONG_CONTEXT_DECAY:
            if self.percentile is None:
                raise ValueError("long_context_decay compares a percentile of long and short context: give one")
            if self.of not in LATENCY_METRICS:
                raise ValueError("long_context_decay's 'of' must be a latency metric")
            if self.short_max_tokens >= self.long_min_tokens:
                raise ValueError("short_max_tokens must be below long_min_tokens")
        return self

    @property
    def is_latency(self) -> bool:
        return self.metric in LATENCY_METRICS

    @property
    def quantile(self) -> float | None:
        return None if self.percentile is None else self.percentile / 100.0

    @property
    def label(self) -> str:
        """A short stable name, e.g. ``e2e_p99`` or ``ttft_p95[mobile]``."""
        if self.name:
            return self.name
        base = self.metric.value
        if self.percentile is not None:
            p = f"{self.percentile:g}".replace(".", "_")
            base = f"{base}_p{p}"
        if self.metric is Metric.LONG_CONTEXT_DECAY:
            base = f"{base}_{self.of.value}"
        tags = [*self.where.clients, *self.where.lanes, *(f"!{lane}" for lane in self.where.not_lanes),
                *self.where.business_types, *self.where.regions]
        if self.where.peak_only:
            tags.append("peak")
        if self.where.min_input_tokens is not None:
            tags.append(f">={self.where.min_input_tokens}tok")
        return f"{base}[{','.join(tags)}]" if tags else base

    def met_by(self, value: float) -> bool:
        return value <= self.threshold if self.comparison == "<=" else value < self.threshold

    def describe(self) -> str:
        if self.metric in RATE_METRICS:
            target = f"{self.metric.value} {self.comparison} {self.threshold:.3%}"
        elif self.metric is Metric.LONG_CONTEXT_DECAY:
            target = (
                f"{self.of.value} P{self.percentile:g} at >= {self.long_min_tokens} tokens {self.comparison} "
                f"{1 + self.threshold:.2f} x short context (<= {self.short_max_tokens} tokens)"
            )
        else:
            target = f"{self.metric.value} P{self.percentile:g} {self.comparison} {self.threshold * 1000:g} ms"
        return f"{target} ({self.label})" if not self.where.is_empty else target


class RequestBound(BaseModel):
    """A per-request bound that defines goodput (bench): ``metric <= threshold`` for the requests of
    ``business_types`` (all when empty; all when no request has a business type and ``all_if_unlabelled``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # figures end up in arithmetic

    metric: Metric
    threshold: float = Field(ge=0)
    business_types: tuple[str, ...] = ()
    all_if_unlabelled: bool = False

    @field_validator("threshold", mode="before")
    @classmethod
    def _quantity(cls, v: Any) -> Any:
        return _parse_quantity(v)

    @field_validator("business_types", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return (v,) if isinstance(v, str) else v

    @model_validator(mode="after")
    def _latency(self) -> RequestBound:
        if self.metric not in LATENCY_METRICS:
            raise ValueError(f"a request bound needs a latency metric, not {self.metric.value!r}")
        return self


class SLOProfile(BaseModel):
    """A named set of objectives, applied to the traffic its ``applies_to`` selector matches.

    ``request_bounds``: the per-request bounds that define goodput in ``tailguard bench``; None derives them from
    the latency objectives (per metric and business types, the threshold of the highest percentile).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # figures end up in arithmetic

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str = ""
    applies_to: Selector = Selector()
    objectives: tuple[Objective, ...] = Field(min_length=1)
    request_bounds: tuple[RequestBound, ...] | None = None

    @model_validator(mode="after")
    def _unique_labels(self) -> SLOProfile:
        seen: set[str] = set()
        for o in self.objectives:
            if o.label in seen:
                raise ValueError(f"two objectives share the label {o.label!r}: give one a distinct 'name'")
            seen.add(o.label)
        return self

    def objective(self, metric: Metric | str, percentile: float | None = None) -> Objective | None:
        """The first objective on ``metric`` (and ``percentile``) with no ``where`` narrowing, if any."""
        m = Metric(metric)
        for o in self.objectives:
            if o.metric is m and o.where.is_empty and (percentile is None or o.percentile == percentile):
                return o
        return None

    def latency_objectives(self) -> list[Objective]:
        return [o for o in self.objectives if o.is_latency]

    def _first(self, metric: Metric) -> Objective | None:
        return next((o for o in self.objectives if o.metric is metric and o.where.is_empty), None)

    @property
    def max_error_rate(self) -> float | None:
        """The error-rate objective's limit over all of the profile's traffic, if it has one."""
        o = self._first(Metric.ERROR_RATE)
        return None if o is None else o.threshold

    @property
    def max_degraded_rate(self) -> float | None:
        """The degradation-rate limit (at peak or always), if the profile has one."""
        o = next((o for o in self.objectives if o.metric is Metric.DEGRADATION_RATE
                  and o.where.model_copy(update={"peak_only": False}).is_empty), None)
        return None if o is None else o.threshold

    @property
    def long_context(self) -> Objective | None:
        """The long-context decay objective, if any."""
        return self._first(Metric.LONG_CONTEXT_DECAY)

    def selects_on_business_types_only(self, o: Objective, ignore_peak: bool = False) -> bool:
        """True when neither the objective nor the profile narrows the traffic by anything but business type."""
        for sel in (o.where, self.applies_to):
            rest = sel.model_copy(update={"business_types": (), **({"peak_only": False} if ignore_peak else {})})
            if not rest.is_empty:
                return False
        return True

    def business_types_of(self, o: Objective) -> tuple[str, ...]:
        """The business types an objective applies to: its own ``where``, else the profile's ``applies_to``."""
        return tuple(b.lower() for b in (o.where.business_types or self.applies_to.business_types))

    def goodput_bounds(self, judged: Iterable[Objective] | None = None) -> tuple[RequestBound, ...]:
        """``request_bounds``, or, when not given, per latency metric and business types the threshold of the
        highest-percentile objective among ``judged`` (by default the latency objectives that select on business
        types only: a bound is checked per request, which carries no lane or client class in a bench run)."""
        if self.request_bounds is not None:
            return self.request_bounds
        if judged is None:
            judged = [o for o in self.latency_objectives() if self.selects_on_business_types_only(o)]
        top: dict[tuple[Metric, tuple[str, ...]], Objective] = {}
        for o in judged:
            if not o.is_latency or o.percentile is None:
                continue
            key = (o.metric, self.business_types_of(o))
            if key not in top or o.percentile > (top[key].percentile or 0):
                top[key] = o
        return tuple(RequestBound(metric=m, threshold=o.threshold, business_types=bts,
                                  all_if_unlabelled=o.all_if_unlabelled) for (m, bts), o in top.items())

    def describe(self) -> str:
        lines = [f"{self.name}: {self.description}" if self.description else self.name]
        lines += [f"  - {o.describe()}" for o in self.objectives]
        return "\n".join(lines)


def _o(metric: str, threshold: float, percentile: float | None = None, **kw: Any) -> Objective:
    return Objective(metric=Metric(metric), threshold=threshold, percentile=percentile, **kw)


def builtin_profiles() -> dict[str, SLOProfile]:
    """The built-in profiles, fresh copies. ``advanced`` builds on ``baseline`` and ``strict`` on ``advanced``."""
    base_objs = (
        _o("e2e", 0.45, 50),
        _o("e2e", 1.2, 95),
        _o("e2e", 2.0, 99),
        _o("error_rate", 0.005, comparison="<"),
    )
    baseline = SLOProfile(
        name="baseline",
        description="baseline SLO profile: E2E P50 <= 450 ms, P95 <= 1.2 s, P99 <= 2 s, errors < 0.5%",
        objectives=base_objs,
    )
    adv_objs = (
        *base_objs,
        _o("ttft", 0.35, 99),
        _o("ttft", 0.30, 99, where=Selector(clients=("mobile",))),
        _o("ttft", 0.20, 99, where=Selector(lanes=("vip",))),
        _o("long_context_decay", 0.40, 99, of=Metric.E2E, long_min_tokens=65536, short_max_tokens=8192),
        _o("degradation_rate", 0.02, comparison="<", where=Selector(peak_only=True)),
    )
    advanced = SLOProfile(
        name="advanced",
        description=(
            "advanced SLO profile: baseline, plus TTFT <= 350 ms (mobile <= 300 ms, VIP <= 200 ms), P99 at 64K "
            "context at most 40% above short context, peak-hour degradation rate < 2%"
        ),
        objectives=adv_objs,
    )
    finance_e2e = _o("e2e", 1.5, 99, where=Selector(business_types=("finance",)), all_if_unlabelled=True,
                     name="finance Q&A: E2E P99 <= 1.5 s")
    medical_e2e = _o("e2e", 3.0, 95, where=Selector(business_types=("medical",)),
                     name="medical reports: E2E P95 <= 3 s")
    strict = SLOProfile(
        name="strict",
        description=("strict SLO profile: advanced, plus finance Q&A E2E P99 <= 1.5 s and medical report "
                     "generation E2E P95 <= 3 s"),
        objectives=(*adv_objs, finance_e2e, medical_e2e),
    )
    finance = SLOProfile(
        name="strict-finance",
        description="strict scenario: finance Q&A, E2E P99 <= 1.5 s",
        applies_to=Selector(business_types=("finance",)),
        objectives=(_o("e2e", 1.5, 99), _o("error_rate", 0.005, comparison="<")),
    )
    medical = SLOProfile(
        name="strict-medical",
        description="strict scenario: medical report generation, E2E P95 <= 3 s",
        applies_to=Selector(business_types=("medical",)),
        objectives=(_o("e2e", 3.0, 95), _o("error_rate", 0.005, comparison="<")),
    )
    return {p.name: p for p in (baseline, advanced, strict, finance, medical)}


BUILTIN_PROFILES: Mapping[str, SLOProfile] = builtin_profiles()
_ALIASES = {"finance": "strict-finance", "medical": "strict-medical", "strict_finance": "strict-finance",
            "strict_medical": "strict-medical"}


def profile_names() -> list[str]:
    return list(BUILTIN_PROFILES)


def get_profile(name: str, extra: Mapping[str, SLOProfile] | None = None) -> SLOProfile:
    """A profile by name: ``extra`` (e.g. from :func:`load_profiles`) first, then the built-in ones."""
    if extra and name in extra:
        return extra[name]
    key = _ALIASES.get(name, name)
    if key in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[key]
    known = sorted({*BUILTIN_PROFILES, *(extra or {})})
    raise KeyError(f"unknown SLO profile {name!r}; known: {', '.join(known)}")


def _format_errors(exc: ValidationError, where: str) -> str:
    lines = []
    errors = exc.errors()
    for err in errors:
        # pydantic also reports "too short" for a list whose every item failed: the item errors say more.
        if err["type"] == "too_short" and any(
            len(o["loc"]) > len(err["loc"]) and o["loc"][: len(err["loc"])] == err["loc"] for o in errors
        ):
            continue
        loc = ".".join(str(p) for p in err["loc"] if p not in ("function-after", "function-before"))
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"  {where}{'.' + loc if loc else ''}: {msg}")
    return "\n".join(lines)


def parse_profiles(data: Any, source: str = "<profiles>") -> dict[str, SLOProfile]:
    """Validate an already-parsed mapping (``{"profiles": {name: {...}}}`` or ``{name: {...}}``)."""
    if data is None:
        raise ProfileError(f"{source}: empty file")
    if not isinstance(data, Mapping):
        raise ProfileError(f"{source}: expected a mapping with a 'profiles' key, got {type(data).__name__}")
    body = data.get("profiles", data) if "profiles" in data else data
    if not isinstance(body, Mapping):
        raise ProfileError(f"{source}: 'profiles' must map names to profiles, got {type(body).__name__}")
    if not body:
        raise ProfileError(f"{source}: no profiles defined")
    out: dict[str, SLOProfile] = {}
    problems: list[str] = []
    for name, spec in body.items():
        where = f"profiles.{name}"
        if not isinstance(spec, Mapping):
            problems.append(f"  {where}: expected a mapping, got {type(spec).__name__}")
            continue
        spec = dict(spec)
        spec.setdefault("name", str(name))
        parent = spec.pop("extends", None)
        if parent is not None:
            try:
                base = get_profile(str(parent), out)
            except KeyError as e:
                problems.append(f"  {where}.extends: {e.args[0]}")
                continue
            spec["objectives"] = [o.model_dump() for o in base.objectives] + list(spec.get("objectives") or [])
            spec.setdefault("applies_to", base.applies_to.model_dump())
        try:
            out[str(name)] = SLOProfile.model_validate(spec)
        except ValidationError as e:
            problems.append(_format_errors(e, where))
    if problems:
        raise ProfileError(f"{source}: invalid SLO profiles:\n" + "\n".join(problems))
    return out


def load_profiles(yaml_path: str | Path, include_builtin: bool = False) -> dict[str, SLOProfile]:
    """Read custom profiles from YAML. Raises :class:`ProfileError` naming the file, profile and field at fault."""
    import yaml

    path = Path(yaml_path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ProfileError(f"{path}: cannot read: {e.strerror or e}") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ProfileError(f"{path}: not valid YAML: {e}") from e
    loaded = parse_profiles(data, str(path))
    if include_builtin:
        return {**builtin_profiles(), **loaded}
    return loaded


def profiles_for(
    profiles: Iterable[SLOProfile], *, business_type: str | None = None, lane: str | None = None
) -> list[SLOProfile]:
    """The profiles whose ``applies_to`` matches a business type and lane."""
    return [p for p in profiles if p.applies_to.matches(business_type=business_type, lane=lane)]
