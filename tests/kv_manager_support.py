"""The slot manager without an engine: stand-in requests carrying the fields it reads, driven as
vLLM's scheduler drives it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import RequestStatus

from proxima.engine.kv_manager import PrefixHitBlocks, SlotKVCacheManager


@dataclass
class StandInRequest:
    """The Request fields the slot manager reads."""

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    skip_reading_prefix_cache: bool = False
    mm_features: list = field(default_factory=list)
    lora_request: object | None = None
    cache_salt: str | None = None
    prompt_embeds: object | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def manager(num_slots: int = 1024, exact_figures: bool = True) -> SlotKVCacheManager:
    spec = FullAttentionSpec(1, num_kv_heads=1, head_size=8, dtype=torch.float32)
    config = KVCacheConfig(num_slots, [], [KVCacheGroupSpec(["layer.0"], spec)])
    return SlotKVCacheManager(config, max_model_len=4096, scheduler_block_size=1, hash_block_size=1,
                              log_stats=True, prefix_caching=True, exact_figures=exact_figures)


def admit(mgr: SlotKVCacheManager, req: StandInRequest) -> int:
    blocks, num_hit, _ = mgr.get_computed_blocks(req)
    hit = blocks if isinstance(blocks, PrefixHitBlocks) else None
    assert mgr.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit) is not None
    req.num_computed_tokens = req.num_tokens
    req.status = RequestStatus.RUNNING
    return num_hit
