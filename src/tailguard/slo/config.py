"""The SLO monitor's configuration: one validated model, loadable from YAML (``slo:`` section or a file of its own).

Every figure the requirements give is a default here; all are configurable. Example::

    slo:
      profiles: [baseline, advanced]
      profiles_file: my-profiles.yaml
      tiers:
        judge:
          - {metric: ttft, percentile: 99, yellow: 1.8, orange: 2.5, red: 3.0}
          - {metric: tpot, percentile: 99, yellow: 0.25, orange: 0.4, red: 0.6}
        clear_ratio: 0.9
        min_samples: 50
        min_dwell_s: 60
      peak: {mode: configured, hours: ["09:00-12:00", "19:00-22:00"], timezone: Asia/Shanghai}
      actions:
        dry_run: false
        scale_out: {webhook_url: http://autoscaler:8080/scale, replicas_pct: 10}
        # or, on a gateway, replicas it starts itself (docs/gateway.md, "Scale-out that acts"):
        # scale_out: {replicas_pct: 10, provider: {kind: process, command: "vllm serve m --port {port}",
        #                                           min_replicas: 0, max_replicas: 4}}
        shed: {non_core_business_types: [batch], non_core_lanes: [batch], status: 429, retry_after_s: 30}
        degrade: {mode: truncate, max_tokens: 64}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tailguard.slo.profiles import Metric, ProfileError, Selector

__all__ = [
    "ActionsConfig",
    "AutoscaleConfig",
    "DegradeConfig",
    "GoldenRulesConfig",
    "HotspotConfig",
    "MonitorConfig",
    "PeakConfig",
    "ProcessProviderConfig",
    "ScaleOutConfig",
    "ScopeConfig",
    "ShedConfig",
    "TierMetric",
    "TierPolicy",
    "load_monitor_config",
]

TIERS = ("green", "yellow", "orange", "red")

# Upper bounds of durations: a value past them is a typo or a unit mistake, and some (1e300, .inf) would pass
# validation only to overflow where the server turns them into slot counts or Retry-After headers.
MINUTE_S = 60.0
HOUR_S = 3600.0
DAY_S = 86_400.0
WEEK_S = 7 * DAY_S
# The windows' slots and the evaluation run at most this often: below it the evaluation thread becomes a busy loop.
MIN_TICK_S = 0.1
# Slots in the longest window: each query merges one aggregate per slot, so this bounds an evaluation's cost.
MAX_WINDOW_SLOTS = 10_000


class _M(BaseModel):
    # No inf or NaN in any float field: every figure here ends up in arithmetic, a header or a JSON payload.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# Legacy shorthand: ``tiers: {metric: e2e, yellow: 1.8, orange: 2.5, red: 3.0}`` judges one metric (E2E unless
# ``metric`` says otherwise, as before judged metrics were configurable).
_SHORTHAND = ("metric", "percentile", "yellow", "orange", "red")
_SHORTHAND_DEFAULTS = {"metric": "e2e", "percentile": 99.0, "yellow": 1.8, "orange": 2.5, "red": 3.0}
TIER_METRICS = (Metric.TTFT, Metric.TPOT, Metric.E2E, Metric.E2E_PER_TOKEN, Metric.ITL, Metric.QUEUE_WAIT)


class TierMetric(_M):
    """One metric a tier judges, at one percentile, with its own yellow/orange/red thresholds (seconds).

    ``skip_degraded``: leave requests an action changed (a truncated answer) out of this metric's judgement, so
    that an action cannot clear its own tier by lowering the metric it is judged on. ``None`` (the default) skips
    them for ``e2e`` only: truncation shortens E2E directly, while TTFT and TPOT move only with the load.
    """

    metric: Metric
    percentile: float = Field(default=99.0, gt=0, lt=100)
    yellow: float = Field(gt=0, le=DAY_S)
    orange: float = Field(gt=0, le=DAY_S)
    red: float = Field(gt=0, le=DAY_S)
    skip_degraded: bool | None = None

    @model_validator(mode="after")
    def _ordered(self) -> TierMetric:
        if not self.yellow < self.orange < self.red:
            raise ValueError(f"tier thresholds must rise: yellow {self.yellow} < orange {self.orange} < red {self.red}")
        if self.metric not in TIER_METRICS:
            raise ValueError(f"tiers need a latency metric ({', '.join(m.value for m in TIER_METRICS)}), "
                             f"not {self.metric.value}")
        return self

    def threshold(self, level: int) -> float:
        return (self.yellow, self.orange, self.red)[level - 1]

    @property
    def excludes_degraded(self) -> bool:
        return self.metric is Metric.E2E if self.skip_degraded is None else self.skip_degraded

    @property
    def label(self) -> str:
        return f"{self.metric.value} p{self.percentile:g}"


def _default_judge() -> list[TierMetric]:
    # The required 1.8 / 2.5 / 3 s, read as the wait before an answer starts (TTFT), which does not grow with
    # max_tokens; and the pace of the answer once it flows (TPOT): 0.6 s per token is under 2 tokens/s.
    return [
        TierMetric(metric=Metric.TTFT, percentile=99, yellow=1.8, orange=2.5, red=3.0),
        TierMetric(metric=Metric.TPOT, percentile=99, yellow=0.25, orange=0.4, red=0.6),
    ]


class TierPolicy(_M):
    """Tiered alerts. Each metric in ``judge`` has its own thresholds; the scope's tier is the worst of them.

    By default the tiers judge TTFT P99 (1.8 / 2.5 / 3 s) and TPOT P99 (0.25 / 0.4 / 0.6 s per token): neither
    grows with the length of an answer, so a healthy server that writes long answers stays green. E2E
    (``metric: e2e``) or E2E per output token (``e2e_per_token``) can be judged instead or as well.

    A tier is raised when a value exceeds its threshold for ``raise_after`` consecutive evaluations, and cleared
    when the value falls to ``clear_ratio`` x its threshold or below for ``clear_after`` consecutive evaluations
    (hysteresis), and not before it has held ``min_dwell_s`` (damping: an action that relieves the load must not
    switch itself off and on every few seconds). An evaluation with fewer than ``min_samples`` values changes
    nothing, except that a tier whose evidence has aged out of the window (no evaluation with enough samples has
    supported it for a whole window length) clears: a tier never holds on no evidence.
    """

    judge: list[TierMetric] = Field(default_factory=_default_judge, min_length=1)
    clear_ratio: float = Field(default=0.9, gt=0, le=1)
    raise_after: int = Field(default=1, ge=1)
    clear_after: int = Field(default=3, ge=1)
    min_samples: int = Field(default=50, ge=1)
    min_dwell_s: float = Field(default=60.0, ge=0, le=DAY_S)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(k in data for k in _SHORTHAND):
            if "judge" in data:
                raise ValueError(f"give either 'judge' or the one-metric shorthand ({', '.join(_SHORTHAND)}), "
                                 "not both")
            data = dict(data)
            one = {k: data.pop(k) if k in data else _SHORTHAND_DEFAULTS[k] for k in _SHORTHAND}
            data["judge"] = [one]
        return data

    @model_validator(mode="after")
    def _distinct(self) -> TierPolicy:
        labels = [j.label for j in self.judge]
        if len(set(labels)) != len(labels):
            raise ValueError(f"judged metrics repeat: {labels}")
        return self

    # The first judged metric, for callers that know only one (rules export, CLI summary).
    @property
    def metric(self) -> Metric:
        return self.judge[0].metric

    @property
    def percentile(self) -> float:
        return self.judge[0].percentile

    @property
    def yellow(self) -> float:
        return self.judge[0].yellow

    @property
    def orange(self) -> float:
        return self.judge[0].orange

    @property
    def red(self) -> float:
        return self.judge[0].red

    def threshold(self, level: int) -> float:
        return self.judge[0].threshold(level)

    def describe(self) -> str:
        return "; ".join(f"{j.metric.value} P{j.percentile:g} {j.yellow:g} / {j.orange:g} / {j.red:g} s"
                         for j in self.judge)


class ScopeConfig(_M):
    """A slice of traffic with tiers of its own. The default is one scope, ``all``."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    where: Selector = Selector()
    tiers: TierPolicy | None = None  # None: the monitor's tiers


class PeakConfig(_M):
    mode: Literal["configured", "detected", "always", "never"] = "detected"
    hours: list[str] = Field(default_factory=list)
    timezone: str = "UTC"
    enter_ratio: float = Field(default=1.5, gt=1, le=1000)
    exit_ratio: float = Field(default=1.2, gt=0, le=1000)
    min_rps: float = Field(default=0.5, ge=0, le=1e9)
    baseline_half_life_s: float = Field(default=6 * 3600.0, ge=MINUTE_S, le=WEEK_S)
    warmup_s: float = Field(default=1800.0, ge=0, le=WEEK_S)

    @model_validator(mode="after")
    def _hours(self) -> PeakConfig:
        if self.hours and self.mode == "detected":
            self.mode = "configured"
        if self.mode == "configured" and not self.hours:
            raise ValueError("peak.mode 'configured' needs peak.hours, e.g. ['09:00-12:00']")
        if self.exit_ratio > self.enter_ratio:
            raise ValueError("peak.exit_ratio must not exceed peak.enter_ratio")
        from tailguard.slo.windows import _parse_hours

        for h in self.hours:
            _parse_hours(h)
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"peak.timezone: unknown time zone {self.timezone!r}") from None
        return self


class GoldenRulesConfig(_M):
    """The golden rules as advisories, never pages.

    They fire on healthy traffic: for lognormal latency with log-sigma s, P99/P50 = exp(2.326 s) exceeds 3 once
    s > 0.47, and P99/P95 = exp(0.681 s) exceeds 1.5 once s > 0.60; LLM end-to-end latency, which scales with the
    output length, commonly has s between 0.5 and 1. Calibrate the ratios on your own traffic.
    """

    enabled: bool = True
    metric: Metric = Metric.E2E
    p99_over_p50: float = Field(default=3.0, gt=1, le=1000)
    p99_over_p95: float = Field(default=1.5, gt=1, le=1000)
    clear_ratio: float = Field(default=0.95, gt=0, le=1)
    min_samples: int = Field(default=200, ge=1)


class HotspotConfig(_M):
    """Hotspots: requests slower than exp(mean + sigma x std) of the window's log E2E."""

    sigma: float = Field(default=2.0, gt=0, le=100)
    stage_sigma: float = Field(default=2.0, gt=0, le=100)
    min_samples: int = Field(default=30, ge=2)
    max_reported: int = Field(default=20, ge=0)


def _split_command(v: Any) -> Any:
    if isinstance(v, str):
        import shlex

        return shlex.split(v)
    return v



class AutoscaleConfig(_M):
    """The provider follows the gateway's backlog, beside the tiers (``tailguard.backends.upstream.autoscale``): a
    replica starts once a request has waited ``wait_s`` at the gateway (or the replicas queue ``queued_per_replica``
    each) for ``sustain_s``; the newest stops, drained, once nothing waits and the requests in flight fit the others
    at ``scale_in_utilization`` for ``scale_in_after_s``; one step per ``cooldown_s`` at most."""

    wait_s: float = Field(default=1.0, gt=0, le=HOUR_S)
    queued_per_replica: float = Field(default=4.0, gt=0, le=1e6)
    sustain_s: float = Field(default=1.0, ge=0, le=HOUR_S)
    scale_in_utilization: float = Field(default=0.7, gt=0, le=1)
    scale_in_after_s: float = Field(default=20.0, ge=0, le=DAY_S)
    cooldown_s: float = Field(default=10.0, ge=0, le=DAY_S)
    interval_s: float = Field(default=0.25, ge=0.05, le=MINUTE_S)  # below 0.05 s it polls in a busy loop


class ProcessProviderConfig(_M):
    """Replicas started as processes on the gateway's machine (a gateway over ``upstreams`` only).

    ``command`` is a template: ``{port}`` becomes a free port on 127.0.0.1, ``{name}`` the replica's name and
    ``{host}`` 127.0.0.1 (nothing else in it is touched, so JSON arguments keep their braces). A replica takes traffic
    once ``health_path`` answers 200 and the gateway's own health check of its engine passes, within
    ``start_timeout_s``; otherwise its process is stopped and the attempt recorded as failed. On scale-in it drains
    (no new requests; those in flight finish, for up to ``drain_timeout_s``), leaves the pool, and its process group
    gets SIGTERM, then SIGKILL after ``stop_grace_s``. ``min_replicas`` and ``max_replicas`` bound the replicas this
    provider runs (the configured upstreams are not counted).
    """

    kind: Literal["process"] = "process"
    command: list[str] = Field(min_length=1)
    name_prefix: str = Field(default="scaled", pattern=r"^[A-Za-z0-9_.\-]+$")
    min_replicas: int = Field(default=0, ge=0)
    max_replicas: int = Field(default=4, ge=1)
    start_timeout_s: float = Field(default=60.0, gt=0, le=DAY_S)
    drain_timeout_s: float = Field(default=30.0, ge=0, le=DAY_S)
    stop_grace_s: float = Field(default=10.0, gt=0, le=HOUR_S)
    health_path: str = Field(default="/v1/models", pattern=r"^/")
    env: dict[str, str] = Field(default_factory=dict)  # added to the gateway's environment
    cwd: str | None = None
    log_dir: str | None = None  # each replica's stdout and stderr; None: a temporary directory
    # How the gateway treats each replica (as an entry of ``upstreams`` would say).
    max_concurrent: int = Field(default=64, ge=1)
    engine: Literal["auto", "tailguard", "vllm", "sglang", "llamacpp", "openai"] = "auto"
    send_priority: bool = False
    preempts: bool = False
    # None: replicas start and stop on the SLO tiers' scale-out alone
    autoscale: AutoscaleConfig | None = None

    @field_validator("command", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        return _split_command(v)

    @model_validator(mode="after")
    def _check(self) -> ProcessProviderConfig:
        if not any("{port}" in arg for arg in self.command):
            raise ValueError("the replica command needs {port} (the port the replica must listen on), e.g. "
                             "'python -m tailguard.cli serve --model fake --port {port}'")
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must not exceed max_replicas ({self.max_replicas})")
        if self.preempts and not self.send_priority:
            raise ValueError("preempts: true needs send_priority: true (the replica preempts by the priority it is "
                             "sent)")
        return self


class ScaleOutConfig(_M):
    """Yellow: ask for ``replicas_pct`` more replicas through a webhook POST and/or a command (JSON on stdin), and/or
    start them in-process through a replica ``provider`` (a gateway over upstream replicas)."""

    webhook_url: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    command: list[str] | None = None
    replicas_pct: float = Field(default=10.0, gt=0, le=1000)  # at most 10x the replicas in one step
    timeout_s: float = Field(default=5.0, gt=0, le=HOUR_S)
    undo: bool = True  # ask for the replicas back when yellow clears
    provider: ProcessProviderConfig | None = None

    @field_validator("command", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        return _split_command(v)


class ShedConfig(_M):
    """Orange: refuse traffic of non-core business types, lanes or tenants with ``status`` and ``Retry-After``.

    Tenants are the API keys' tenants (never a header). Protection wins over every non-core match: a request in a
    protected lane, or of a protected tenant, is never shed."""

    enabled: bool = True
    non_core_business_types: list[str] = Field(default_factory=lambda: ["batch"])
    non_core_lanes: list[str] = Field(default_factory=lambda: ["batch"])
    non_core_tenants: list[str] = Field(default_factory=list)
    protected_lanes: list[str] = Field(default_factory=lambda: ["vip"])
    protected_tenants: list[str] = Field(default_factory=list)
    status: Literal[429, 503] = 429
    retry_after_s: float = Field(default=30.0, ge=0, le=DAY_S)


class DegradeConfig(_M):
    """Red: degrade the affected traffic (the red scope's, minus protected lanes and tenants). Shedding goes on meanwhile (red
    implies orange), so non-core traffic is refused first.

    ``mode: truncate`` (the default) serves the request with at most ``max_tokens`` output tokens: a real, shorter
    answer that a client can tell from a full one (``finish_reason: "length"`` when the cap cut it, and a
    ``tailguard.degraded`` field). ``mode: template`` (opt-in) answers with ``template`` and no model call. Either
    way the response and the record are marked degraded.
    """

    enabled: bool = True
    mode: Literal["truncate", "template"] = "truncate"
    template: str = (
        "The service is under unusually heavy load and cannot give a full answer right now. "
        "Please retry in a minute."
    )
    max_tokens: int = Field(default=64, ge=1)
    protected_lanes: list[str] = Field(default_factory=list)
    protected_tenants: list[str] = Field(default_factory=list)  # the API keys' tenants whose answers are never degraded
    # Serve every n-th affected request normally (0: none). These probes are the undisturbed answers a tier judged
    # on E2E reads (truncated ones are left out); under a template nothing else reaches the engine at all.
    probe_every: int = Field(default=10, ge=0)


class ActionsConfig(_M):
    dry_run: bool = False
    inline_hooks: bool = False  # run hooks inside evaluate() (tests); by default a background thread runs them
    scale_out: ScaleOutConfig = ScaleOutConfig()
    shed: ShedConfig = ShedConfig()
    degrade: DegradeConfig = DegradeConfig()


class MonitorConfig(_M):
    enabled: bool = True
    profiles: list[str] = Field(default_factory=lambda: ["baseline"])
    profiles_file: str | None = None
    eval_interval_s: float = Field(default=5.0, ge=MIN_TICK_S, le=HOUR_S)
    slot_s: float = Field(default=30.0, ge=MIN_TICK_S, le=HOUR_S)
    peak_window_s: float = Field(default=300.0, gt=0, le=DAY_S)
    offpeak_window_s: float = Field(default=900.0, gt=0, le=DAY_S)
    peak: PeakConfig = PeakConfig()
    tiers: TierPolicy = TierPolicy()
    scopes: list[ScopeConfig] = Field(default_factory=lambda: [ScopeConfig(name="all")])
    golden_rules: GoldenRulesConfig = GoldenRulesConfig()
    hotspots: HotspotConfig = HotspotConfig()
    long_context_tokens: int = Field(default=8192, ge=1)
    objective_min_samples: int = Field(default=20, ge=1)
    max_keys: int = Field(default=512, ge=1, le=100_000)
    # Regions that keep their name in the windows (the regions view queries each one every evaluation).
    max_regions: int = Field(default=32, ge=1, le=1024)
    max_records: int = Field(default=1000, ge=10)  # alert/action records kept in memory for alerts()
    actions: ActionsConfig = ActionsConfig()

    @model_validator(mode="after")
    def _check(self) -> MonitorConfig:
        if self.slot_s > min(self.peak_window_s, self.offpeak_window_s):
            raise ValueError("slot_s must not exceed the windows")
        if self.max_window_s / self.slot_s > MAX_WINDOW_SLOTS:
            raise ValueError(f"the longest window ({self.max_window_s:g} s) holds more than {MAX_WINDOW_SLOTS} slots of "
                             f"slot_s ({self.slot_s:g} s): make slot_s at least {self.max_window_s / MAX_WINDOW_SLOTS:g}")
        if "scopes" not in self.model_fields_set:
            # The default scope judges the traffic shedding protects: every lane but the non-core ones, whose
            # requests wait in their lane by design (a batch flood waiting its turn must not degrade everyone else).
            self.scopes = [ScopeConfig(name="all", where=Selector(not_lanes=tuple(self.actions.shed.non_core_lanes)))]
        names = [s.name for s in self.scopes]
        if len(set(names)) != len(names):
            raise ValueError(f"scope names repeat: {names}")
        if not self.scopes:
            raise ValueError("give at least one scope (the default is 'all')")
        # Unknown profile names fail here, when the config is read, not when the server starts the monitor.
        from tailguard.slo.profiles import get_profile, load_profiles

        extra = load_profiles(self.profiles_file) if self.profiles_file else {}
        for name in self.profiles:
            try:
                get_profile(name, extra)
            except KeyError as e:
                raise ValueError(e.args[0]) from None
        return self

    @property
    def max_window_s(self) -> float:
        return max(self.peak_window_s, self.offpeak_window_s)


def load_monitor_config(path: str | Path) -> MonitorConfig:
    """Read a YAML file holding either the monitor's fields or an ``slo:`` section. Raises ProfileError."""
    import yaml

    from tailguard.slo.profiles import _format_errors

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ProfileError(f"{p}: {e}") from e
    if isinstance(data, dict) and "slo" in data:
        data = data["slo"] or {}
    try:
        return MonitorConfig.model_validate(data)
    except ValidationError as e:
        raise ProfileError(f"{p}: invalid SLO monitor config:\n" + _format_errors(e, "slo")) from None
