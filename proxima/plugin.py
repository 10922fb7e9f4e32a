"""vLLM general plugin: loaded by every vLLM process (API server, EngineCore, workers).

It must stay cheap and idempotent. With PROXIMA_ALLOCATOR set (token or block: `proxima serve`)
it installs the request guards (`proxima.engine.request_guards`: two requests that end stock
vLLM's engine are answered instead), each in the process that needs it. With
PROXIMA_ALLOCATOR=token it also points vLLM's attention backend registry at Proxima's slot-table
backend: the CUSTOM entry (chosen with `--attention-backend CUSTOM` on CUDA) and the CPU_ATTN
entry, because the CPU platform ignores `--attention-backend` and always asks for CPU_ATTN.
Without PROXIMA_ALLOCATOR it changes nothing.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

BACKEND_PATH = "proxima.engine.attention.backend.ProximaSlotAttentionBackend"
_registered = False
_slot_backend = False


def register() -> None:
    global _registered, _slot_backend
    if _registered:
        return
    _registered = True
    from proxima.engine.settings import ProximaConfigError, ProximaSettings

    try:
        settings = ProximaSettings.from_env()
    except ProximaConfigError as err:
        logger.error("Proxima plugin left off: %s", err)
        return
    if settings.allocator is None:
        return
    from proxima.engine.request_guards import install

    install()
    if not settings.token_slots:
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    _slot_backend = True


def registered_backend() -> str | None:
    """What this process's registry holds for the rest of its life: "slots" (Proxima's backend),
    "stock", or None before vLLM has loaded the plugin here. An engine of the other kind needs
    another process (proxima.harness keeps to that)."""
    if not _registered:
        return None
    return "slots" if _slot_backend else "stock"
