"""Launch Proxima's Triton kernels through their compiled handles: less host time per launch.

Why: vLLM runs attention outside CUDA graphs in mixed prefill+decode steps (its default
FULL_AND_PIECEWISE mode), once per layer per step. There, host time is step time: measured on
the H200 machine (scripts/gpu/e2e.py --profile, 1 GiB KV budget), Proxima's eager attention
layer cost 178 us of host time against FlashAttention 3's 101 us, and the engine ran 1.18x
slower per step with the GPU doing less work. Most of the difference is `JITFunction.run`, which
per launch re-derives the specialization key, formats the options, checks globals and builds
launch metadata before calling the compiled launcher.

How: the caller gives a key that covers everything Triton specializes on for its arguments
(tensor dtypes and 16-byte alignment, the value of every specialized int, constexprs, launch
options, device). The first launch of a key goes through Triton (which compiles or finds the
binary) and its `CompiledKernel` is kept; later launches call the compiled launcher directly
with the same positional arguments (constexprs included: the launcher skips them).

Falls back to the plain Triton launch whenever the fast path does not apply: under the
interpreter (no compiled kernel), with a launch hook installed (profilers), or on a Triton whose
`CompiledKernel` lacks the expected handles.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from triton import knobs
from triton.runtime import driver

# A key per (kernel, shape class); bounded so a long-running server with odd shapes cannot grow it.
_MAX_KEYS = 1024


class CompiledLaunch:
    """``launch(grid, args, key, **options)`` == ``fn[grid](*args, **options)``, cheaper on a hit."""

    def __init__(self, fn) -> None:
        self._fn = fn
        self._compiled: dict[Hashable, object] = {}

    def __call__(self, grid: tuple[int, int, int], args: Sequence, key: Hashable, **options) -> None:
        kernel = None if _hooks_installed() else self._compiled.get(key)
        if kernel is None:
            compiled = self._fn[grid](*args, **options)
            if _launchable(compiled) and len(self._compiled) < _MAX_KEYS:
                self._compiled[key] = compiled
            return
        kernel.run(grid[0], grid[1], grid[2], _current_stream(), kernel.function, kernel.packed_metadata,
                   None, None, None, *args)

    def compile(self, grid: tuple[int, int, int], args: Sequence, key: Hashable, **options) -> bool:
        """Compile (or find in Triton's caches) what ``launch`` would run, launching nothing.

        False when the key was already kept (nothing to do), True when Triton was asked."""
        if key in self._compiled:
            return False
        compiled = self._fn.warmup(*args, grid=grid, **options)
        if hasattr(compiled, "result"):  # Triton's asynchronous compile mode hands back a future
            compiled = compiled.result()
        if _launchable(compiled) and len(self._compiled) < _MAX_KEYS:
            self._compiled[key] = compiled
        return True


def _current_stream() -> int:
    """The stream Triton itself would launch on (torch's current stream of the current device)."""
    return driver.active.get_current_stream(driver.active.get_current_device())


def _hooks_installed() -> bool:
    """A launch hook is set (Triton 3.6 keeps a HookChain, empty when none; older ones None)."""
    hook = knobs.runtime.launch_enter_hook
    return bool(getattr(hook, "calls", hook))


def _launchable(compiled: object) -> bool:
    return all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))


def tensor_key(tensors: Sequence[torch.Tensor]) -> tuple:
    """What Triton specializes a pointer argument on: its dtype and whether it is 16-byte aligned."""
    return tuple((t.dtype, t.data_ptr() % 16 == 0) for t in tensors)
