"""OpenTelemetry traces' settings (docs/observability.md): a section of the server's config file, kept apart from
``tracing`` so that reading a config never imports the OpenTelemetry SDK."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class TracingConfig(BaseModel):
    """OpenTelemetry traces (docs/observability.md): off unless an OTLP/HTTP endpoint is set."""

    model_config = ConfigDict(extra="forbid")
    otlp_endpoint: str | None = Field(None, description="OTLP/HTTP collector, e.g. http://127.0.0.1:4318 (the "
                                                        "/v1/traces path is added to a bare host); unset = no traces")
    service_name: str = Field("tailguard", min_length=1)
    sample_ratio: float = Field(1.0, ge=0, le=1, description="share of new traces kept; a client's sampled flag wins")
    export_timeout_s: float = Field(10.0, gt=0, description="one export attempt's limit (in the exporter's thread)")

    @field_validator("otlp_endpoint")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return None
        v = v.strip()
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"otlp_endpoint must be an http:// or https:// URL, not {v!r}")
        return v

    @property
    def enabled(self) -> bool:
        return self.otlp_endpoint is not None
