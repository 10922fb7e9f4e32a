"""Which vLLM configurations Proxima's token allocator serves, checked before anything starts.

One function, used twice: by `proxima serve` before it launches vLLM (so a refused option costs
the user one clear line and no half-started server) and by the scheduler inside the engine (for
users who enable the plugin by hand).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def unsupported_options(vllm_config) -> list[str]:
    """Each entry names one option Proxima's token allocator cannot serve, and the way out."""
    problems: list[str] = []
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    if cache.block_size != 1:
        problems.append(
            f"--block-size {cache.block_size}: Proxima allocates single-token slots; drop "
            "--block-size, or use --proxima-allocator block for block allocation"
        )
    if cache.cache_dtype not in ("auto", None):
        problems.append(
            f"--kv-cache-dtype {cache.cache_dtype}: Proxima stores K/V in the model dtype; drop the flag"
        )
    if model is not None:
        if model.use_mla:
            problems.append("multi-head latent attention (MLA) models are not supported by Proxima")
        if model.get_sliding_window() is not None:
            problems.append("sliding-window attention models are not supported by Proxima")
        if model.is_hybrid:
            problems.append("hybrid (attention + state-space) models are not supported by Proxima")
        if model.is_encoder_decoder:
            problems.append("encoder-decoder models are not supported by Proxima")
    if vllm_config.kv_transfer_config is not None:
        problems.append("--kv-transfer-config (KV connectors) is not supported by Proxima")
    if vllm_config.speculative_config is not None:
        problems.append("--speculative-config (speculative decoding) is not supported by Proxima")
    if parallel.pipeline_parallel_size > 1:
        problems.append(
            f"--pipeline-parallel-size {parallel.pipeline_parallel_size}: use tensor parallelism "
            "with Proxima"
        )
    if getattr(parallel, "decode_context_parallel_size", 1) > 1:
        problems.append("--decode-context-parallel-size > 1 is not supported by Proxima")
    return problems
