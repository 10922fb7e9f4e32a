"""vLLM 0.26's own per-token-head KV writer, run under the Triton interpreter: the reference bytes.
On a CUDA host it runs compiled on the GPU instead (vLLM's CUDA build registers no CPU kernels for
the ops around it), and the bytes come back to the CPU: the same comparison against the writer
that serves there.

Run as a script in its own process (`python tests/vllm_reference_kernels.py IN.pt OUT.pt`), because
vLLM's CPU build disables Triton at import (`vllm.triton_utils` finds no GPU driver and hands its
kernels a placeholder), while these tests need vLLM's kernels themselves. The process sets
TRITON_INTERPRET=1 and gives `vllm.triton_utils` the real Triton before any vLLM kernel module
is imported; nothing of vLLM's code is changed. Each case writes K/V rows into vLLM's stock
TRITON_ATTN layout (16-token blocks, `[K codes | K scale | V codes | V scale]` per head and
position, as `TritonAttentionImpl._pth_key_value_caches` makes it) and reads back each token's
codes and scales.
"""

from __future__ import annotations

import os
import sys
import types

BLOCK = 16


def _real_triton() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice

    shim = types.ModuleType("vllm.triton_utils")
    shim.HAS_TRITON, shim.triton, shim.tl, shim.tldevice = True, triton, tl, tldevice
    shim.LOG2E, shim.LOGE2 = 1.4426950408889634, 0.6931471805599453
    sys.modules["vllm.triton_utils"] = shim


def write_stock(key, value, slots, kv_cache_dtype: str) -> dict:
    import torch
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
        triton_reshape_and_cache_flash_per_token_head_quant,
    )
    from vllm.v1.kv_cache_interface import KVQuantMode, get_kv_quant_mode

    mode = get_kv_quant_mode(kv_cache_dtype)
    num_tokens, num_heads, head_size = key.shape
    codes = head_size // 2 if mode == KVQuantMode.INT4_PER_TOKEN_HEAD else head_size
    padded = codes + 4
    num_blocks = int(slots.max()) // BLOCK + 1
    raw = torch.zeros(num_blocks, num_heads, BLOCK, 2 * padded, dtype=torch.uint8, device=key.device)
    key_cache, value_cache = raw.transpose(1, 2).split(padded, dim=-1)
    if mode == KVQuantMode.FP8_PER_TOKEN_HEAD:
        key_cache = key_cache.view(torch.float8_e4m3fn)
        value_cache = value_cache.view(torch.float8_e4m3fn)
    elif mode == KVQuantMode.INT8_PER_TOKEN_HEAD:
        key_cache, value_cache = key_cache.view(torch.int8), value_cache.view(torch.int8)
    floats = torch.empty(0, dtype=torch.float32, device=key.device).set_(raw.untyped_storage())
    stride = raw.stride()
    scale_strides = (stride[0] // 4, stride[2] // 4, stride[1] // 4)  # (block, position, head)
    k_scale = floats.as_strided((num_blocks, BLOCK, num_heads), scale_strides, codes // 4)
    v_scale = floats.as_strided((num_blocks, BLOCK, num_heads), scale_strides, (padded + codes) // 4)
    triton_reshape_and_cache_flash_per_token_head_quant(
        key, value, key_cache, value_cache, k_scale, v_scale, slots, kv_quant_mode=mode)
    assert STR_DTYPE_TO_TORCH_DTYPE[kv_cache_dtype].itemsize == 1
    block, position = slots // BLOCK, slots % BLOCK
    return {
        "k_codes": key_cache[block, position, :, :codes].view(torch.uint8).cpu(),
        "v_codes": value_cache[block, position, :, :codes].view(torch.uint8).cpu(),
        "k_scales": k_scale[block, position].cpu(),
        "v_scales": v_scale[block, position].cpu(),
    }


def write_slots(key, value, slots, kv_cache_dtype: str):
    """vLLM's writer on Proxima's slot views, as `per_token_head.write` runs it on CUDA: the
    slot records it leaves ([S, Hkv * record] uint8)."""
    import torch

    from proxima.engine.attention import per_token_head, pth_cuda_write

    fmt = per_token_head.PTH_FORMATS[kv_cache_dtype]
    num_heads, head_size = key.shape[1], key.shape[2]
    raw = torch.zeros(int(slots.max()) + 1, 1, num_heads, fmt.record_bytes(head_size), dtype=torch.uint8,
                      device=key.device)
    cache = per_token_head.cache_views(raw, fmt, num_heads, head_size)
    pth_cuda_write.vllm_write(key, value, cache, slots)
    return cache.rows.cpu()


def hadacore_stand_in(x, inplace: bool = True):
    """What vLLM's CUDA Hadamard kernel (hadacore) returns for bf16 rows, ``x @ H / sqrt(D)``
    rounded to bf16, computed on the CPU. Any such rounding serves the tests that use it: a
    rotation held to vLLM's chain must give the chain's bits whatever hadacore's own are (on a
    GPU the real kernel runs)."""
    import math

    from proxima.engine.attention.per_token_head import _butterfly

    y = (_butterfly(x.float()) / math.sqrt(x.shape[-1])).to(x.dtype)
    return x.copy_(y) if inplace else y


def use_hadacore_stand_in() -> None:
    """vLLM's int4 rotation as on a CUDA machine (its hadacore tier), with the stand-in above."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.ops import int4_per_token_head as vllm_int4

    ops.hadacore_transform = hadacore_stand_in
    vllm_int4._HADACORE_AVAILABLE = True


def write_slots_both_ways(key, value, slots) -> dict:
    """int4 records written on Proxima's slot views twice: by `pth_cuda_write.vllm_write` (its short
    rotation for bf16 rows, then vLLM's quantising kernel) and by vLLM's whole writer, rotation
    chain included, as the write ran before."""
    import torch
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
        triton_reshape_and_cache_flash_per_token_head_quant,
    )
    from vllm.v1.kv_cache_interface import KVQuantMode

    from proxima.engine.attention import per_token_head, pth_cuda_write

    fmt = per_token_head.PTH_FORMATS["int4_per_token_head"]
    num_heads, head_size = key.shape[1], key.shape[2]

    def cache():
        raw = torch.zeros(int(slots.max()) + 1, 1, num_heads, fmt.record_bytes(head_size),
                          dtype=torch.uint8, device=key.device)
        return per_token_head.cache_views(raw, fmt, num_heads, head_size)

    short, chain = cache(), cache()
    assert pth_cuda_write._rotated_pair(key, value) is not None, "the short rotation must serve this batch"
    pth_cuda_write.vllm_write(key, value, short, slots)
    triton_reshape_and_cache_flash_per_token_head_quant(
        key, value, *(t.unsqueeze(1) for t in (chain.k_codes, chain.v_codes, chain.k_scales, chain.v_scales)),
        slots, kv_quant_mode=KVQuantMode.INT4_PER_TOKEN_HEAD)
    return {"short": short.rows.cpu(), "chain": chain.rows.cpu()}


def main(in_path: str, out_path: str) -> None:
    """IN.pt: {"cases": [...], "rotation": {key, value, slots}}; OUT.pt: each case's bytes as
    written by vLLM's writer and on the slot views, and the rotation pair's two records."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        _real_triton()

    def here(c: dict) -> dict:
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in c.items()}

    given = torch.load(in_path)
    results = [{**write_stock(c["key"], c["value"], c["slots"], c["kv_cache_dtype"]),
                "slot_records": write_slots(c["key"], c["value"], c["slots"], c["kv_cache_dtype"]),
                "device": device}
               for c in map(here, given["cases"])]
    if device == "cpu":  # after the cases: they hold the CPU writer to vLLM's CPU tier
        use_hadacore_stand_in()
    pair = here(given["rotation"])
    rotation = write_slots_both_ways(pair["key"], pair["value"], pair["slots"])
    torch.save({"cases": results, "rotation": rotation}, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
