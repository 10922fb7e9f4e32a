"""Server readings the doctor needs that `ServerSnapshot` does not carry (yet).

Layer: a thin shim over the scrape layer. It reuses `proxima.scrape`'s own exposition parser, so
there is still one parser, and it returns an immutable snapshot like the scrape layer does. Every
field here is a candidate for `ServerSnapshot`; when the scrape layer grows them, this module
shrinks to a re-export.

Never raises: a server that is down yields `ok=False`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx

from proxima.metrics import catalog as c
from proxima.scrape import HistogramSnapshot, _Samples

_CONFIG_NOISE = {"engine", "None", ""}
# Labels that describe features Proxima's users do not tune (hybrid models, bookkeeping).
_CONFIG_HIDDEN_PREFIXES = ("_", "mamba_", "user_specified_")


@dataclass(frozen=True, slots=True)
class ServerExtras:
    ok: bool
    error: str | None = None
    cache_config: dict[str, str] = field(default_factory=dict)  # labels of vllm:cache_config_info
    prompt_tokens: HistogramSnapshot = field(default_factory=HistogramSnapshot)  # per finished request
    generation_tokens: HistogramSnapshot = field(default_factory=HistogramSnapshot)  # per finished request
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    # The API server's own RSS (absent under PROMETHEUS_MULTIPROC_DIR, i.e. under `proxima serve`).
    process_rss_bytes: float | None = None

    def config_int(self, key: str) -> int | None:
        try:
            return int(float(self.cache_config[key]))
        except (KeyError, ValueError):
            return None

    def config_float(self, key: str) -> float | None:
        try:
            return float(self.cache_config[key])
        except (KeyError, ValueError):
            return None


def parse_extras(text: str) -> ServerExtras:
    s = _Samples(text)
    config_rows = s.labels_of(c.Vllm.CACHE_CONFIG_INFO)
    config = {k: v for k, v in (config_rows[0] if config_rows else {}).items()
              if k not in _CONFIG_NOISE and not k.startswith(_CONFIG_HIDDEN_PREFIXES) and v not in _CONFIG_NOISE}
    return ServerExtras(
        ok=True,
        cache_config=config,
        prompt_tokens=s.histogram(c.Vllm.REQUEST_PROMPT_TOKENS),
        generation_tokens=s.histogram(c.Vllm.REQUEST_GENERATION_TOKENS),
        prefix_cache_queries=s.total(c.Vllm.PREFIX_CACHE_QUERIES) or 0.0,
        prefix_cache_hits=s.total(c.Vllm.PREFIX_CACHE_HITS) or 0.0,
        process_rss_bytes=s.total(c.Vllm.PROCESS_RESIDENT_MEMORY),
    )


async def scrape_extras(client: httpx.AsyncClient, url: str, timeout: float = 5.0) -> ServerExtras:
    try:
        response = await client.get(url.rstrip("/") + "/metrics", timeout=timeout)
        response.raise_for_status()
        return parse_extras(response.text)
    except (httpx.HTTPError, ValueError) as err:
        return ServerExtras(ok=False, error=f"{type(err).__name__}: {err}")
