"""Proxima's engine: token-granular KV slots inside vLLM.

Layers, from the bottom:
  slot_allocator.SlotAllocator   which physical KV slots are free (pure numpy, no vLLM)
  slot_table.RequestSlotTable    which slots each request holds, in token order (pure numpy)
  kv_manager.SlotKVCacheManager  vLLM's KVCacheManager interface over the two above
  kv_sources.*KVSource           what the KV cache holds, read from each allocator's own state
  scheduler.ProximaScheduler     vLLM's scheduler with that manager, publishing a source's figures
  attention/                     the attention backend that reads K/V through the slot table

Only the modules that talk to vLLM import it; the allocator and slot table are tested alone.
"""
