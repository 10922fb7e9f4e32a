"""vLLM attention backend that reads K/V through a per-token slot table (KV block size 1).

Layer: the worker side of Proxima. With block size 1 the worker's block table *is* the slot
table (row r, column p: the slot holding position p of request r), and vLLM's slot mapping is
where each new token's K/V goes. This module adapts vLLM's backend interface to the
implementations of one contract: `triton_attention` (the CUDA path), `vllm_cpu_kernel` (the CPU
path for an unquantised cache: vLLM's own CPU kernel over the gathered slots) and `reference`
(batched torch: the CPU path for quantised caches, and the reference).

KV layout (why): one tensor per layer of shape (num_slots, 1, Hkv, 2*D), K and V side by side
per head as in vLLM 0.26's own backends. A token's K/V for all heads is one contiguous row, so a
gather through the slot table reads whole rows whatever order the slots are in.

fp8 KV cache (``--kv-cache-dtype fp8|fp8_e4m3|fp8_e5m2``): vLLM allocates the cache as uint8 and
this backend views it as the fp8 type; each layer's ``_k_scale`` / ``_v_scale`` (one element,
or one per KV head) go to both implementations as tensors (``quant.py`` states the semantics).

Per-token-head KV (``--kv-cache-dtype {int8,fp8,int4}_per_token_head``): each slot row holds, per
KV head, vLLM's ``[K codes | K scale | V codes | V scale]`` record (``per_token_head.py``), so the
cache is ``(num_slots, 1, Hkv, record)`` bytes and both implementations get the layer's views.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

from proxima.engine import heap_trim
from proxima.engine.attention import launch_args, per_token_head, vllm_cpu_kernel
from proxima.engine.attention.per_token_head import PTH_FORMATS, PTHCache, pth_format
from proxima.engine.attention.planning import capturing
from proxima.engine.attention.quant import FP8_KV_DTYPES, KVScales, storage_dtype
from proxima.engine.attention.reference import slot_attention_torch
from proxima.engine.attention.slot_rows import write_kv
from proxima.engine.settings import int4_decode_from_env

# vLLM looks the name up in its backend enum: CUSTOM is the slot for third-party backends.
BACKEND_NAME = "CUSTOM"


class ProximaSlotAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False
    accept_output_buffer: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", *FP8_KV_DTYPES, *PTH_FORMATS]

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        return [1]

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size in (None, 1)

    @classmethod
    def supports_per_head_quant_scales(cls) -> bool:
        return True  # the kernels read scale[kv_head]: one element or Hkv of them, alike

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [32, 64, 80, 96, 112, 128, 160, 192, 224, 256]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[ProximaSlotAttentionImpl]:
        return ProximaSlotAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[ProximaSlotMetadataBuilder]:
        return ProximaSlotMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        if block_size != 1:
            raise ValueError(f"Proxima's slot attention needs KV block size 1, got {block_size}")
        fmt = pth_format(cache_dtype_str)
        if fmt is not None:  # one byte per element: the record's bytes (codes and scales)
            return (num_blocks, block_size, num_kv_heads, fmt.record_bytes(head_size))
        return (num_blocks, block_size, num_kv_heads, 2 * head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        if include_num_layers_dimension:
            return (1, 0, 2, 3, 4)
        return (0, 1, 2, 3)

    @staticmethod
    def use_cascade_attention(*args, **kwargs) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass
class ProximaSlotMetadata:
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    slot_table: torch.Tensor
    slot_mapping: torch.Tensor
    # The batch's longest query on the GPU, by whether a CUDA graph was being captured when it was
    # computed (a warm-up's tensor must never serve a graph, which has to compute its own).
    _longest_query: dict[bool, torch.Tensor] = field(default_factory=dict, repr=False)

    def longest_query(self) -> torch.Tensor:
        """Computed once a step (all layers share the step's metadata), by one small launch."""
        from proxima.engine.attention.triton_attention import longest_query

        key = capturing(self.query_start_loc)
        known = self._longest_query.get(key)
        if known is None:
            known = self._longest_query[key] = longest_query(self.query_start_loc)
        return known


class ProximaSlotMetadataBuilder(AttentionMetadataBuilder[ProximaSlotMetadata]):
    # The Triton path reads only device tensors and sizes fixed at capture: graphs are safe.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    # Not dead, though it only calls super(): vLLM 0.26 declares AttentionMetadataBuilder.__init__
    # abstract, and without an override the engine fails at start-up ("Can't instantiate abstract
    # class ProximaSlotMetadataBuilder").
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> ProximaSlotMetadata:
        m = common_attn_metadata
        heap_trim.note_step()
        return ProximaSlotMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
            query_start_loc=m.query_start_loc[: m.num_reqs + 1],
            query_start_loc_cpu=m.query_start_loc_cpu[: m.num_reqs + 1],
            seq_lens=m.seq_lens[: m.num_reqs],
            slot_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
        )


def uniform_graph_query_len(m: ProximaSlotMetadata) -> int | None:
    """The longest query of every batch that the CUDA graph being captured (if one is) replays,
    where vLLM says so: its uniform-decode FULL graphs (``BatchDescriptor.uniform``) replay only
    batches of 1 + speculative tokens a request, the capture's ``max_query_len``. They then get the
    decode plan, not the mixed one a graph of unknown batches needs. None: not known."""
    if not is_forward_context_available():
        return None
    descriptor = get_forward_context().batch_descriptor
    return m.max_query_len if descriptor is not None and descriptor.uniform else None


class ProximaSlotAttentionImpl(AttentionImpl):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **unsupported,
    ) -> None:
        refused = {
            "ALiBi": alibi_slopes is not None,
            "sliding window": sliding_window is not None,
            "logits soft cap": bool(logits_soft_cap),
            "attention sinks": sinks is not None,
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
            f"KV cache dtype {kv_cache_dtype}": (kv_cache_dtype != "auto"
                                                 and storage_dtype(kv_cache_dtype) is None
                                                 and pth_format(kv_cache_dtype) is None),
            f"{kv_cache_dtype} with head size {head_size} (a power of two is needed for its rotation)":
                kv_cache_dtype == "int4_per_token_head" and head_size & (head_size - 1) != 0,
        }
        if any(refused.values()):
            names = ", ".join(k for k, v in refused.items() if v)
            raise NotImplementedError(f"Proxima's slot attention does not support {names}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8_dtype = storage_dtype(kv_cache_dtype)  # None: K/V stored in the model dtype
        self.pth_fmt = pth_format(kv_cache_dtype)  # None: not a per-token-head cache
        if self.pth_fmt is not None and self.pth_fmt.packed:
            # This engine's switch, read as it is built: launch_args may have been imported earlier.
            launch_args.INT4_DECODE = int4_decode_from_env()
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self._kv_views: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._pth: PTHCache | None = None
        self._scales: KVScales | None = None
        self._variants_ready = False

    def _split(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # A layer's cache tensor lives as long as the engine: make its K and V views once, not
        # twice per layer per step (host time counts in steps that run outside CUDA graphs).
        if self._kv_views is None or self._kv_views[0] is not kv_cache:
            if self.pth_fmt is not None:
                self._pth = per_token_head.cache_views(kv_cache, self.pth_fmt, self.num_kv_heads,
                                                       self.head_size)
                self._kv_views = (kv_cache, self._pth.k_codes, self._pth.v_codes)
                return self._kv_views[1], self._kv_views[2]
            # vLLM allocates an fp8 cache as uint8; reading those codes as values would be wrong.
            cache = kv_cache if self.fp8_dtype is None else kv_cache.view(self.fp8_dtype)
            rows = cache.view(kv_cache.shape[0], self.num_kv_heads, 2 * self.head_size)
            self._kv_views = (kv_cache, rows[..., : self.head_size], rows[..., self.head_size :])
        return self._kv_views[1], self._kv_views[2]

    def _kv_scales(self, layer: torch.nn.Module) -> KVScales | PTHCache | None:
        """The layer's own scale tensors (read in place each step: calibration may update them);
        a per-token-head cache's views (after `_split`), whose scales live in the slots."""
        if self.pth_fmt is not None:
            return self._pth
        if self.fp8_dtype is None:
            return None
        known = self._scales
        if known is None or known.k is not layer._k_scale or known.v is not layer._v_scale:
            self._scales = KVScales(layer._k_scale, layer._v_scale)
        return self._scales

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if self.kv_sharing_target_layer_name is not None:
            return
        k_cache, v_cache = self._split(kv_cache)
        scales = self._kv_scales(layer)
        if isinstance(scales, PTHCache):
            per_token_head.write(key, value, scales, slot_mapping)
        elif key.is_cuda:
            from proxima.engine.attention.triton_write_kv import write_kv_triton

            write_kv_triton(key, value, k_cache, v_cache, slot_mapping, scales)
        else:
            # Toward zero, as vLLM's CPU writer (cpu_attn_reshape_and_cache) quantises: the same
            # model then holds the same fp8 cache under Proxima and stock vLLM on CPU.
            write_kv(key, value, k_cache, v_cache, slot_mapping, scales, rounding="toward_zero")

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: ProximaSlotMetadata | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert output is not None, "Proxima's backend writes into vLLM's output buffer"
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by Proxima")
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        m = attn_metadata
        k_cache, v_cache = self._split(kv_cache)
        scales = self._kv_scales(layer)
        q = query.view(query.shape[0], self.num_heads, self.head_size)
        out = output.view(output.shape[0], self.num_heads, self.head_size)
        if q.is_cuda:
            from proxima.engine.attention.triton_attention import slot_attention_triton
            from proxima.engine.attention.warmup import precompile_attention_once

            if not self._variants_ready:  # first calls run in vLLM's warm-up, before serving
                self._variants_ready = precompile_attention_once(
                    q, k_cache, v_cache, m.slot_table, m.query_start_loc, m.seq_lens, out, scales)
            # A plan of two launches asks for the batch's longest query: once a step, not once a layer.
            slot_attention_triton(
                q, k_cache, v_cache, m.slot_table, m.query_start_loc, m.seq_lens, self.scale, out,
                num_actual_tokens=m.num_actual_tokens, max_query_len=m.max_query_len,
                max_seq_len=m.max_seq_len, graph_max_query_len=uniform_graph_query_len(m), kv_scales=scales,
                longest_query=m.longest_query,
            )
        elif not (vllm_cpu_kernel.serves(q, k_cache, scales) and vllm_cpu_kernel.attend(
                q, k_cache, v_cache, m.slot_table, m.query_start_loc_cpu, m.seq_lens, self.scale, out,
                num_actual_tokens=m.num_actual_tokens)):
            slot_attention_torch(
                q, k_cache, v_cache, m.slot_table, m.query_start_loc_cpu, m.seq_lens, self.scale,
                out, num_actual_tokens=m.num_actual_tokens, kv_scales=scales,
            )
        return output
