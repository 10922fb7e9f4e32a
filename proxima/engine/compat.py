"""Which vLLM configurations Proxima's token allocator serves, checked before anything starts.

One function, used twice: by `proxima serve` before it launches vLLM (so a refused option costs
the user one clear line and no half-started server) and by the scheduler inside the engine (for
users who enable the plugin by hand).
"""

from __future__ import annotations

# The quantised KV caches Proxima's slot kernels store: vLLM's per-tensor or per-head scaled fp8
# (attention/quant.py) and its per-token-head formats (attention/per_token_head.py). Kept here as
# names so that this check imports neither torch nor vLLM.
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
PER_TOKEN_HEAD_KV_CACHE_DTYPES = ("int8_per_token_head", "fp8_per_token_head", "int4_per_token_head")
SERVED_KV_CACHE_DTYPES = (*FP8_KV_CACHE_DTYPES, *PER_TOKEN_HEAD_KV_CACHE_DTYPES)


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
    problems.extend(_kv_cache_dtype_problems(cache))
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


def _kv_cache_dtype_problems(cache) -> list[str]:
    dtype = cache.cache_dtype
    if dtype in ("auto", None):
        return []
    if dtype not in SERVED_KV_CACHE_DTYPES:
        return [(
            f"--kv-cache-dtype {dtype}: Proxima stores K/V in the model dtype or as "
            f"{', '.join(SERVED_KV_CACHE_DTYPES)}; pick one of those or drop the flag"
        )]
    problems = []
    if getattr(cache, "kv_cache_dtype_skip_layers", None):
        # Skipped layers keep the model dtype: two page sizes, which one slot pool cannot hold.
        problems.append(
            "--kv-cache-dtype-skip-layers: Proxima keeps one KV dtype for every layer; drop the flag"
        )
    capability = _cuda_capability()
    if dtype.startswith("fp8") and capability is not None and capability < (8, 9):
        problems.append(
            f"--kv-cache-dtype {dtype}: Proxima's fp8 kernels need a GPU of compute capability 8.9 "
            f"or newer (this one is {capability[0]}.{capability[1]}); drop the flag"
        )
    return problems


def _cuda_capability() -> tuple[int, int] | None:
    """The first CUDA device's compute capability, or None where there is no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(0)
