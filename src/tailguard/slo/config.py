"""The SLO monitor's configuration: one validated model, loadable from YAML (``slo:`` section or a file of its own).

Every figure the seed gives is a default here; all are configurable. Example::

    slo:
      profiles: [baseline, advanced]
      profiles_file: my-profiles.yaml
      tiers: {yellow: 1.8, orange: 2.5, red: 3.0, clear_ratio: 0.9, min_samples: 50}
      peak: {mode: configured, hours: ["09:00-12:00", "19:00-22:00"], timezone: Asia/Shanghai}
      actions:
        dry_run: false
        scale_out: {webhook_url: http://autoscaler:8080/scale, replicas_pct: 10}
        shed: {non_core_business_types: [batch], non_core_lanes: [batch], status: 429, retry_after_s: 30}
        degrade: {template: "High load: a short answer follows.", max_tokens: 64}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tailguard.slo.profiles import Metric, ProfileError, Selector

__all__ = [
    "ActionsConfig",
    "DegradeConfig",
    "GoldenRulesConfig",
    "HotspotConfig",
    "MonitorConfig",
    "PeakConfig",
    "ScaleOutConfig",
    "ScopeConfig",
    "ShedConfig",
    "TierPolicy",
    "load_monitor_config",
]

TIERS = ("green", "yellow", "orange", "red")


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TierPolicy(_M):
    """Tiered alerts (S3) on one percentile of one latency metric.

    A tier is raised when the value exceeds its threshold for ``raise_after`` consecutive evaluations, and cleared
    when the value falls to ``clear_ratio`` x its threshold or below for ``clear_after`` consecutive evaluations
    (hysteresis: with the defaults yellow rises above 1.8 s and clears at 1.62 s). Evaluations with fewer than
    ``min_samples`` values in the window change nothing.
    """

    metric: Metric = Metric.E2E
    percentile: float = Field(default=99.0, gt=0, lt=100)
    yellow: float = Field(default=1.8, gt=0)
    orange: float = Field(default=2.5, gt=0)
    red: float = Field(default=3.0, gt=0)
    clear_ratio: float = Field(default=0.9, gt=0, le=1)
    raise_after: int = Field(default=1, ge=1)
    clear_after: int = Field(default=3, ge=1)
    min_samples: int = Field(default=50, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> TierPolicy:
        if not self.yellow < self.orange < self.red:
            raise ValueError(f"tier thresholds must rise: yellow {self.yellow} < orange {self.orange} < red {self.red}")
        if self.metric not in (Metric.E2E, Metric.TTFT, Metric.ITL, Metric.QUEUE_WAIT, Metric.TPOT):
            raise ValueError(f"tiers need a latency metric, not {self.metric.value}")
        return self

    def threshold(self, level: int) -> float:
        return (self.yellow, self.orange, self.red)[level - 1]


class ScopeConfig(_M):
    """A slice of traffic with tiers of its own. The default is one scope, ``all``."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    where: Selector = Selector()
    tiers: TierPolicy | None = None  # None: the monitor's tiers


class PeakConfig(_M):
    mode: Literal["configured", "detected", "always", "never"] = "detected"
    hours: list[str] = Field(default_factory=list)
    timezone: str = "UTC"
    enter_ratio: float = Field(default=1.5, gt=1)
    exit_ratio: float = Field(default=1.2, gt=0)
    min_rps: float = Field(default=0.5, ge=0)
    baseline_half_life_s: float = Field(default=6 * 3600.0, gt=0)
    warmup_s: float = Field(default=1800.0, ge=0)

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
    """The seed's golden rules (S5) as advisories, never pages.

    They fire on healthy traffic: for lognormal latency with log-sigma s, P99/P50 = exp(2.326 s) exceeds 3 once
    s > 0.47, and P99/P95 = exp(0.681 s) exceeds 1.5 once s > 0.60; LLM end-to-end latency, which scales with the
    output length, commonly has s between 0.5 and 1. Calibrate the ratios on your own traffic.
    """

    enabled: bool = True
    metric: Metric = Metric.E2E
    p99_over_p50: float = Field(default=3.0, gt=1)
    p99_over_p95: float = Field(default=1.5, gt=1)
    clear_ratio: float = Field(default=0.95, gt=0, le=1)
    min_samples: int = Field(default=200, ge=1)


class HotspotConfig(_M):
    """Hotspots (T4): requests slower than exp(mean + sigma x std) of the window's log E2E."""

    sigma: float = Field(default=2.0, gt=0)
    stage_sigma: float = Field(default=2.0, gt=0)
    min_samples: int = Field(default=30, ge=2)
    max_reported: int = Field(default=20, ge=0)


class ScaleOutConfig(_M):
    """Yellow: ask for ``replicas_pct`` more replicas through a webhook POST and/or a command (JSON on stdin)."""

    webhook_url: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    command: list[str] | None = None
    replicas_pct: float = Field(default=10.0, gt=0)
    timeout_s: float = Field(default=5.0, gt=0)
    undo: bool = True  # ask for the replicas back when yellow clears

    @field_validator("command", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        if isinstance(v, str):
            import shlex

            return shlex.split(v)
        return v


class ShedConfig(_M):
    """Orange: refuse traffic of non-core business types or lanes with ``status`` and ``Retry-After``."""

    enabled: bool = True
    non_core_business_types: list[str] = Field(default_factory=lambda: ["batch"])
    non_core_lanes: list[str] = Field(default_factory=lambda: ["batch"])
    protected_lanes: list[str] = Field(default_factory=lambda: ["vip"])
    status: Literal[429, 503] = 429
    retry_after_s: float = Field(default=30.0, ge=0)


class DegradeConfig(_M):
    """Red: answer the affected traffic (the red scope's, minus protected lanes) with a degradation template.

    ``mode: template`` answers with ``template`` and no model call; ``mode: truncate`` serves the request with at
    most ``max_tokens`` output tokens. Either way the response and the record are marked degraded.
    """

    enabled: bool = True
    mode: Literal["template", "truncate"] = "template"
    template: str = (
        "The service is under unusually heavy load and cannot give a full answer right now. "
        "Please retry in a minute."
    )
    max_tokens: int = Field(default=64, ge=1)
    protected_lanes: list[str] = Field(default_factory=list)
    # Serve every n-th affected request normally (0: none). Without these probes a fully degraded scope sends no
    # traffic to the engine, its window empties, and red could only ever clear by ageing out of the window.
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
    eval_interval_s: float = Field(default=5.0, gt=0)
    slot_s: float = Field(default=30.0, gt=0)
    peak_window_s: float = Field(default=300.0, gt=0)
    offpeak_window_s: float = Field(default=900.0, gt=0)
    peak: PeakConfig = PeakConfig()
    tiers: TierPolicy = TierPolicy()
    scopes: list[ScopeConfig] = Field(default_factory=lambda: [ScopeConfig(name="all")])
    golden_rules: GoldenRulesConfig = GoldenRulesConfig()
    hotspots: HotspotConfig = HotspotConfig()
    long_context_tokens: int = Field(default=8192, ge=1)
    objective_min_samples: int = Field(default=20, ge=1)
    max_keys: int = Field(default=512, ge=1)
    max_records: int = Field(default=1000, ge=10)  # alert/action records kept in memory for alerts()
    actions: ActionsConfig = ActionsConfig()

    @model_validator(mode="after")
    def _check(self) -> MonitorConfig:
        if self.slot_s > min(self.peak_window_s, self.offpeak_window_s):
            raise ValueError("slot_s must not exceed the windows")
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
