"""The server's settings: defaults < YAML file (``--config``) < command-line flags, validated in one place."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from tailguard.backends.upstream.pool import RoutingConfig, UpstreamConfig
from tailguard.observe.tracing_config import TracingConfig
from tailguard.policy.lanes import CapacityConfig, LaneConfig, default_lanes
from tailguard.policy.tenants import describe_yaml_error
from tailguard.slo.config import MonitorConfig


def default_store_path() -> str:
    root = os.environ.get("TAILGUARD_HOME")
    base = Path(root) if root else Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "tailguard"
    return str(base / "requests.sqlite3")


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _tracing_from_env(data: dict[str, Any]) -> None:
    """The OpenTelemetry SDK's standard variables, where the file and the flags set nothing: the signal's own
    endpoint is taken as is, the general one gets /v1/traces appended (as the OTLP exporter specification says)."""
    tracing = data.pop("tracing", None)
    if tracing is None:  # absent, or an empty ``tracing:`` section in the file
        tracing = {}
    elif not isinstance(tracing, dict):
        data["tracing"] = tracing
        return  # let validation say what is wrong with it
    if not tracing.get("otlp_endpoint"):
        if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            tracing["otlp_endpoint"] = os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
        elif os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            tracing["otlp_endpoint"] = os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"
    if "service_name" not in tracing and os.environ.get("OTEL_SERVICE_NAME"):
        tracing["service_name"] = os.environ["OTEL_SERVICE_NAME"]
    if tracing:
        data["tracing"] = tracing


class FakeEngineConfig(BaseModel):
    """Scripted timings for ``--model fake`` (no model: tests, demos, overhead benchmarks)."""

    model_config = ConfigDict(extra="forbid")
    ttft: float = Field(0.02, ge=0)
    itl: float = Field(0.005, ge=0)
    jitter: float = Field(0.0, ge=0, le=1)
    prefill_per_token: float = Field(0.0, ge=0)
    max_num_seqs: int = Field(256, ge=1)
    max_model_len: int = Field(8192, ge=2)
    output_text: str = "The quick brown fox jumps over the lazy dog. "
    itl_per_running: float = Field(0.0, ge=0, description="added to each decode gap per other running sequence")
    priority_scheduling: bool = Field(False, description="waiting requests take free slots most important (lowest "
                                                             "priority value) first")


class BatchCapConfig(BaseModel):
    """The engine's running-sequence cap and token budget: fixed (``static``, the engine settings) or set each period
    ahead of load from a forecast of arrivals (``forecast``, docs/techniques.md#load-forecast-driven-batching)."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["static", "forecast"] = "static"
    forecaster: Literal["last-value", "moving-mean", "holt-winters", "lstm"] = "holt-winters"
    period_s: float = Field(10.0, gt=0, description="arrivals are counted, and the cap re-planned, per period")
    horizon: int = Field(6, ge=1, le=6, description="periods forecast ahead; the cap holds their peak")
    min_history: int = Field(24, ge=1, description="periods seen before the forecaster replaces last value")
    refit_every: int = Field(36, ge=1, description="periods between refits of the forecaster")
    min_seqs: int = Field(2, ge=1, description="the cap's lower bound (default 2)")
    max_seqs: int = Field(16, ge=1, description="the cap's upper bound (default 16)")
    token_budget: Literal["planned", "engine"] = Field(
        "planned", description="planned: the per-step token budget follows the plan; engine: only the cap changes "
                               "and the budget stays the engine's --max-num-batched-tokens")
    headroom: float = Field(1.25, ge=1)
    target_utilization: float = Field(0.8, gt=0, le=1)
    # The engine's measured throughput (benchmarks/results/engine_throughput.json, SmolLM2 native weights on this
    # CPU); another model or machine should give its own.
    prefill_tokens_per_s: float = Field(821.0, gt=0)
    decode_tokens_per_s: dict[int, float] = Field(default_factory=lambda: {1: 88.9, 16: 362.3, 64: 468.5})
    # Mean tokens per request before any request has finished; then the running means of the requests served.
    mean_input_tokens: float = Field(256.0, ge=0)
    mean_output_tokens: float = Field(64.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> BatchCapConfig:
        if self.min_seqs > self.max_seqs:
            raise ValueError(f"batch_cap: min_seqs ({self.min_seqs}) must be <= max_seqs ({self.max_seqs})")
        if not self.decode_tokens_per_s or any(b < 1 or t <= 0 for b, t in self.decode_tokens_per_s.items()):
            raise ValueError("batch_cap.decode_tokens_per_s: batch sizes >= 1 mapped to tokens/s > 0")
        return self


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = "smollm2"
    served_model_names: list[str] = Field(default_factory=list, description="extra names clients may use")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_queue: int = Field(512, ge=1, description="requests admitted but without a first token; beyond: 429")
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    default_max_tokens: int | None = Field(None, ge=1, description="chat default; None = the rest of the context")
    store_path: str = Field(default_factory=default_store_path, validation_alias=AliasChoices("store_path", "store"),
                            description="request store: a SQLite file path, or a postgresql:// URL ('store' too)")
    store_text: bool = False
    seal_key_file: str | None = Field(None, description="keep each request's token ids, sampling and seed encrypted "
                                      "under this key, for `tailguard rebuild` (else TAILGUARD_SEAL_KEY)")
    retention_days: float = Field(15.0, gt=0)
    sample_interval: float = Field(0.25, gt=0, le=0.5, description="gauge sampling period (<= 500 ms)")
    business_types: list[str] | None = None
    api_key: SecretStr | None = Field(None, description="client key: 'Authorization: Bearer KEY' on the API")
    api_keys: list[SecretStr] = Field(default_factory=list,
                                      description="more client keys; each client key reads only its own records")
    admin_key: SecretStr | None = Field(None, description="admin key: records, alerts and SLO data; unset = closed")
    access_log: bool = True
    log_level: str = "info"
    tokenize_in_thread_chars: int = Field(4096, ge=0, description="longer prompts are tokenized off the event loop")
    # --- the tokenize pipeline (serving/tokenize_pipeline.py) ---
    tokenize_batching: bool = Field(True, description="prompts that arrive together are encoded as one batch on a "
                                                      "worker thread (off: each on the event loop)")
    tokenize_batch_window_s: float = Field(0.0, ge=0, le=0.05,
                                           description="how long a batch waits for more prompts; 0: only for those "
                                                       "that arrive in the same turn of the event loop")
    tokenize_inline_chars: int = Field(256, ge=0, description="a prompt of at most this many characters is encoded "
                                                              "on the event loop at once (cheaper than the thread "
                                                              "hop)")
    tokenizer_glossary: str | None = Field(None, description="a file of domain terms, one a line, kept "
                                                             "pre-tokenized in the tokenize cache; reloaded when it "
                                                             "changes or on POST /admin/tokenizer/glossary")
    tokenizer_glossary_poll_s: float = Field(2.0, gt=0, description="how often the glossary file is checked for "
                                                                    "changes")
    graceful_shutdown_s: float = Field(
        30.0, ge=0, validation_alias=AliasChoices("graceful_shutdown_s", "drain_timeout_s"),
        description="the drain on SIGTERM (serving/drain.py): how long running requests get to finish before their "
                    "answers are ended cleanly ('drain_timeout_s' too)")
    # --- connections (serving/connections.py) ---
    max_connections: int = Field(4096, ge=1, description="client connections served at once; at the cap the "
                                                         "longest idle one is closed, else new requests get 503")
    max_header_bytes: int = Field(64 * 1024, ge=1024, le=16 * 1024 * 1024,
                                  description="a larger request head (request line and headers) is answered 431")
    header_timeout_s: float = Field(10.0, gt=0, description="a request head must arrive within this (else 408)")
    body_timeout_s: float = Field(10.0, gt=0, description="a request body must arrive within this plus 1 s per "
                                                          "body_min_rate bytes received (else 408)")
    body_min_rate: int = Field(16 * 1024, ge=1, description="bytes/s a slow body must keep up (see body_timeout_s)")
    keepalive_timeout_s: float = Field(5.0, gt=0, description="an idle kept-alive connection is closed after this")
    engine: dict[str, Any] = Field(default_factory=dict, description="EngineArgs overrides (kv_cache_tokens, ...)")
    fake: FakeEngineConfig = Field(default_factory=FakeEngineConfig)
    slo: MonitorConfig = Field(default_factory=MonitorConfig, description="the SLO monitor (docs/slo.md)")
    batch_cap: BatchCapConfig = Field(default_factory=BatchCapConfig,
                                      description="static engine caps, or caps set ahead of load by a forecast")
    speculative_audit: float = Field(0.01, ge=0, le=1, description="share of speculative requests rerun without "
                                                                    "speculation to check the output (the consistency audit)")
    # --- the gateway (docs/gateway.md) ---
    upstreams: list[UpstreamConfig] = Field(default_factory=list,
                                            description="serve from these OpenAI-compatible replicas, not a model")
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    keys_file: str | None = Field(None, description="API keys (hashed) -> tenant -> lane; `tailguard keys add`")
    lanes: dict[str, LaneConfig] | None = Field(None, description="lanes with reserved capacity; None: vip, "
                                                                   "standard, batch when keys or upstreams are set")
    capacity: CapacityConfig = Field(default_factory=CapacityConfig)
    default_lane: str = Field("standard", description="the lane of a caller whose key names no tenant")
    redis_url: str | None = Field(None, description="redis://HOST:PORT/DB shared by a fleet of gateways: tenant rate "
                                                    "limits, lane budgets and the SLO windows (docs/gateway.md, Fleet)")
    redis_timeout_s: float = Field(0.25, gt=0, le=10, description="the longest a request waits on Redis before the "
                                                                   "gateway decides alone (fail open)")
    trust_lane_header: bool = Field(False, description="take X-Lane from the client (only behind a proxy that "
                                                       "sets it): otherwise a claimed lane is ignored and recorded")
    direct_relay: bool = Field(True, description="write an upstream's plain tokens to the client from the upstream "
                                                 "read callback (docs/gateway.md, 'The direct relay'); off: every "
                                                 "token through the server's stream")
    # --- the client's network and region (serving/network.py; docs/observability.md, docs/slo.md) ---
    network_sampling: bool = Field(True, description="sample the client connection's TCP state (RTT, retransmits, "
                                                     "send backlog) while an answer is written; Linux only")
    region_header: str | None = Field("x-region", description="the request header that names the client's region "
                                                              "(empty: none)")
    region_cidrs: dict[str, str] = Field(default_factory=dict,
                                         description="client networks -> region ({'10.1.0.0/16': 'eu-west'}), for "
                                                     "requests without the region header; the longest prefix wins")

    @field_validator("store_path")
    @classmethod
    def _store_target(cls, v: str) -> str:
        from tailguard.observe.store import check_store_target

        return check_store_target(v)
    tracing: TracingConfig = Field(default_factory=TracingConfig, description="OpenTelemetry traces over OTLP/HTTP")

    @field_validator("region_cidrs")
    @classmethod
    def _region_cidrs(cls, v: dict[str, str]) -> dict[str, str]:
        import ipaddress

        for cidr, name in v.items():
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"region_cidrs: {cidr!r} is not a network (e.g. 10.1.0.0/16 or 2001:db8::/32)") \
                    from None
            if not str(name).strip():
                raise ValueError(f"region_cidrs: {cidr!r} names no region")
        return v

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("redis_url must be a redis://HOST:PORT/DB, rediss:// or unix:// URL")
        return v or None

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        v = v.lower()
        if v not in {"critical", "error", "warning", "info", "debug", "trace"}:
            raise ValueError("log_level must be one of critical, error, warning, info, debug, trace")
        return v

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, **overrides: Any) -> ServerConfig:
        data: dict[str, Any] = {}
        if path:
            text = Path(path).read_text(encoding="utf-8")
            try:
                loaded = yaml.safe_load(text) or {}
            except yaml.YAMLError as exc:
                # One line without PyYAML's excerpt of the file (its lines may hold keys).
                raise ValueError(f"{path}: {describe_yaml_error(exc)}") from None
            if not isinstance(loaded, dict):
                raise ValueError(f"{path}: the config file must be a mapping of settings")
            data.update(loaded)
        for key, value in overrides.items():
            if key in ("engine", "slo", "tracing", "batch_cap") and isinstance(value, dict):
                data[key] = _deep_merge(data.get(key) or {}, value)
            else:
                data[key] = value
        for key, env in (("api_key", "TAILGUARD_API_KEY"), ("admin_key", "TAILGUARD_ADMIN_KEY")):
            if key not in data and os.environ.get(env):
                data[key] = os.environ[env]
        _tracing_from_env(data)
        return cls.model_validate(data)

    @model_validator(mode="after")
    def _distinct_keys(self) -> ServerConfig:
        # One key for both would make every client an admin: refuse it rather than guess which was meant.
        if self.admin_key is not None and self.admin_key.get_secret_value() in {
                k.get_secret_value() for k in self.client_keys}:
            raise ValueError("admin_key must differ from every client key (an admin key reads every client's "
                             "records)")
        if self.admin_key is not None and not self.admin_key.get_secret_value().strip():
            raise ValueError("admin_key must not be empty")
        return self

    @model_validator(mode="after")
    def _batch_cap_backend(self) -> ServerConfig:
        if self.batch_cap.mode == "forecast" and (self.model == "fake" or self.upstreams):
            raise ValueError("batch_cap mode 'forecast' sets the embedded engine's caps: it needs a model, not "
                             "--model fake or upstreams")
        return self

    @property
    def lanes_enabled(self) -> bool:
        return self.lanes is not None or bool(self.keys_file) or bool(self.upstreams)

    def lane_configs(self) -> dict[str, LaneConfig]:
        lanes = dict(self.lanes) if self.lanes is not None else default_lanes()
        if self.upstreams:  # over replicas every lane keeps time by default: a stopped replica is never silent
            return {name: lane.for_upstreams() for name, lane in lanes.items()}
        return lanes

    @model_validator(mode="after")
    def _lanes(self) -> ServerConfig:
        if self.lanes_enabled and self.default_lane not in self.lane_configs():
            raise ValueError(f"default_lane {self.default_lane!r} is not one of the lanes "
                             f"({', '.join(self.lane_configs())})")
        return self

    @property
    def client_keys(self) -> list[SecretStr]:
        """Every key that may call the API: ``api_key`` and ``api_keys``."""
        return ([self.api_key] if self.api_key is not None else []) + list(self.api_keys)

    def model_names(self, engine_name: str) -> list[str]:
        names = [engine_name, *self.served_model_names]
        if self.model not in names and not self.model.endswith(".gguf") and not self.upstreams:
            names.append(self.model)
        return list(dict.fromkeys(names))
