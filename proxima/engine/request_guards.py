"""Two requests that end stock vLLM 0.26's engine, answered instead (installed by the plugin).

Layer: the plugin (`proxima.plugin` installs these whenever Proxima is switched on, token or
block allocator); nothing else in Proxima changes vLLM's code. Each fix wraps one vLLM method in
the process that runs it, as soon as its module is imported (`after_import`), and touches only
the case that would otherwise kill the engine.

1. Token ids equal to the vocabulary size. vLLM checks a prompt's ids against
   `max(tokenizer.max_token_id, model_vocab_size - 1)` (`v1/engine/input_processor.py`), but a
   Hugging Face tokenizer's `max_token_id` is `max(largest id, tokenizer.vocab_size)`
   (`tokenizers/hf.py`): a count, one past the largest id. So `[3, 512]` on a 512-token model
   passes, indexes one row past the embedding table in the worker (IndexError), and the engine
   dies; every later request gets HTTP 500. The guard (API server) refuses any prompt id at or
   above the model's vocabulary size with vLLM's own out-of-vocabulary ValueError, which the
   server answers with HTTP 400. Multimodal models keep vLLM's rule: their placeholder ids may
   lie beyond the language model's vocabulary and never reach its embedding table.

2. Seeded sampling on CPU when a step's sample is thrown away. A request in a prefill chunk that
   does not reach the end of its tokens (a preempted request resuming, a long prompt chunked) is
   sampled with the batch and its token discarded; vLLM then rewinds the request's generator,
   `gen.set_offset(gen.get_offset() - 4)` (`v1/worker/gpu_model_runner.py`, `_bookkeeping_sync`),
   which a CPU generator refuses: "RuntimeError: CPU Generator does not use offset", engine dead.
   The guard (worker) takes those requests' generators out of the batch for the step, so the
   thrown-away token is drawn from the global generator and the request's own seeded stream is
   left exactly as if that draw had never happened (on CUDA, vLLM's rewind stands).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import sys
from collections.abc import Callable
from types import ModuleType

logger = logging.getLogger(f"vllm.{__name__}")

INPUT_PROCESSOR = "vllm.v1.engine.input_processor"
CPU_MODEL_RUNNER = "vllm.v1.worker.cpu_model_runner"


def install() -> None:
    """Both guards, each in whichever process imports the module it wraps (idempotent)."""
    after_import(INPUT_PROCESSOR, guard_token_ids)
    after_import(CPU_MODEL_RUNNER, guard_cpu_generators)


# ---------------------------------------------------------------- 1. token ids in the vocabulary

def guard_token_ids(module: ModuleType) -> None:
    def wrap(original):
        def _validate_model_input(self, prompt_input, prompt_type, *args, **kwargs):
            original(self, prompt_input, prompt_type, *args, **kwargs)
            ids = prompt_input.get("prompt_token_ids") if prompt_input.get("type") != "embeds" else None
            if ids and not self.model_config.is_multimodal_model:
                vocab_size = self.model_config.get_vocab_size()
                largest = max(ids)
                if largest >= vocab_size:
                    raise ValueError(f"Token id {largest} is out of vocabulary (the model has {vocab_size} "
                                     f"tokens, ids 0 to {vocab_size - 1})")
        return _validate_model_input

    _wrap_once(module.InputProcessor, "_validate_model_input", wrap)


# ---------------------------------------------------------------- 2. seeded sampling on CPU

def guard_cpu_generators(module: ModuleType) -> None:
    def wrap(original):
        def sample_tokens(self, *args, **kwargs):
            generators = self.input_batch.generators
            discarded = self.discard_request_mask.np[:self.input_batch.num_reqs].nonzero()[0]
            held = {i: generators.pop(i) for i in map(int, discarded) if i in generators}
            try:
                return original(self, *args, **kwargs)
            finally:
                generators.update(held)
        return sample_tokens

    _wrap_once(module.CPUModelRunner, "sample_tokens", wrap)


def _wrap_once(owner: type, name: str, wrap: Callable[[Callable], Callable]) -> None:
    """Replace `owner.name` with `wrap(original)`, once: a second install finds the mark."""
    original = getattr(owner, name)
    if getattr(original, "__proxima_guard__", False):
        return
    wrapped = functools.wraps(original)(wrap(original))
    wrapped.__proxima_guard__ = True
    setattr(owner, name, wrapped)


# ---------------------------------------------------------------- installing

def after_import(name: str, patch: Callable[[ModuleType], None]) -> None:
    """`patch(module)` now if `name` is imported, else right after it is, in this process only
    (so a process that never imports `name` never pays for importing it)."""
    if name in sys.modules:
        _patch_logged(patch, sys.modules[name])
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, patch))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `name` is about to be imported, it lets the other finders find
    it and wraps the loader's `exec_module`, so that `patch` runs on the module once executed."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module: ModuleType) -> None:
            exec_module(module)
            _patch_logged(self.patch, module)

        spec.loader.exec_module = exec_then_patch
        return spec


def _patch_logged(patch: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        patch(module)
    except Exception:  # noqa: BLE001 (a guard that no longer fits vLLM must not stop vLLM)
        logger.exception("Proxima: request guard for %s not installed", module.__name__)
