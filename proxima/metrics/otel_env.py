"""Where OpenTelemetry export goes, and the per-request facts it carries (no SDK imports here,
so an engine without an OTLP endpoint never loads the OpenTelemetry SDK)."""

from __future__ import annotations

import os
from dataclasses import dataclass

ENDPOINT_ENV = "PROXIMA_OTLP_ENDPOINT"


ENDPOINT_ENVS = (ENDPOINT_ENV, "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def otlp_endpoint_source() -> tuple[str, str] | None:
    """(endpoint, the variable it came from), first set of ENDPOINT_ENVS; None if none is."""
    for name in ENDPOINT_ENVS:
        value = os.environ.get(name, "").strip()
        if value:
            return value.rstrip("/"), name
    return None


def otlp_endpoint_from_env() -> str | None:
    source = otlp_endpoint_source()
    return source[0] if source else None


def signal_url(endpoint: str, signal: str) -> str:
    # A base endpoint gets the standard OTLP/HTTP paths; a full signal URL is used as given.
    if endpoint.endswith(("/v1/metrics", "/v1/traces")):
        endpoint = endpoint.rsplit("/v1/", 1)[0]
    return f"{endpoint}/v1/{signal}"


@dataclass(frozen=True, slots=True)
class RequestKVFacts:
    request_id: str
    start_time_ns: int
    end_time_ns: int
    slots_peak: int
    preemptions: int
    prompt_tokens: int
    output_tokens: int
