"""CompiledLaunch: the first launch of a key goes through Triton, later ones through the kept
compiled kernel, and anything it cannot vouch for falls back to Triton.

A real compiled kernel needs a GPU (tests/test_attention_kernels.py relaunches real kernels
there); on CPU the Triton side is a recording stand-in with the same call shapes.
"""

from __future__ import annotations

import tests.attention_cases  # noqa: F401  first: sets TRITON_INTERPRET on CPU-only machines

# isort: split

import pytest  # noqa: E402
from triton import knobs  # noqa: E402

from proxima.engine.attention import kernel_launch  # noqa: E402


class FakeCompiled:
    def __init__(self) -> None:
        self.function, self.packed_metadata, self.launches = object(), object(), []

    def run(self, *args) -> None:
        self.launches.append(args)


class FakeJit:
    """``fn[grid](*args, **options)`` like a @triton.jit function, returning its compiled kernel."""

    def __init__(self, compiled) -> None:
        self.compiled, self.launches, self.warmups = compiled, [], []

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.launches.append((grid, args, options))
            return self.compiled
        return launch

    def warmup(self, *args, grid, **options):
        self.warmups.append((grid, args, options))
        return self.compiled


@pytest.fixture(autouse=True)
def _stream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_launch, "_current_stream", lambda: 7)


def _launcher() -> tuple[FakeCompiled, FakeJit, kernel_launch.CompiledLaunch]:
    """A CompiledLaunch over a stand-in Triton function whose compiled kernel records its runs."""
    compiled = FakeCompiled()
    jit = FakeJit(compiled)
    return compiled, jit, kernel_launch.CompiledLaunch(jit)


def test_second_launch_of_a_key_uses_the_compiled_kernel() -> None:
    compiled, jit, launch = _launcher()
    launch((4, 2, 1), (1, 2, "c"), key="k", num_warps=4)
    assert len(jit.launches) == 1 and not compiled.launches
    launch((5, 2, 1), (3, 4, "c"), key="k", num_warps=4)
    assert len(jit.launches) == 1
    (args,) = compiled.launches
    assert args[:4] == (5, 2, 1, 7) and args[4] is compiled.function and args[5] is compiled.packed_metadata
    assert args[6:9] == (None, None, None) and args[9:] == (3, 4, "c")
    launch((5, 2, 1), (3, 4, "c"), key="other", num_warps=8)
    assert len(jit.launches) == 2 and jit.launches[1][2] == {"num_warps": 8}


def test_interpreter_result_is_not_kept() -> None:
    jit = FakeJit(None)  # the interpreter returns no compiled kernel
    launch = kernel_launch.CompiledLaunch(jit)
    for _ in range(3):
        launch((1, 1, 1), (), key="k")
    assert len(jit.launches) == 3


def test_installed_launch_hook_sends_every_launch_through_triton() -> None:
    compiled, jit, launch = _launcher()
    launch((1, 1, 1), (), key="k")

    def hook(metadata) -> None: ...

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch((1, 1, 1), (), key="k")
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(jit.launches) == 2 and not compiled.launches
    launch((1, 1, 1), (), key="k")
    assert len(compiled.launches) == 1


def test_compile_keeps_the_kernel_without_launching_and_the_first_launch_hits_it() -> None:
    compiled, jit, launch = _launcher()
    assert launch.compile((4, 2, 1), (1, 2, "c"), key="k", num_warps=4) is True
    assert jit.warmups == [((4, 2, 1), (1, 2, "c"), {"num_warps": 4})]
    assert not jit.launches and not compiled.launches  # nothing ran
    assert launch.compile((9, 9, 9), (1, 2, "c"), key="k", num_warps=4) is False  # already kept
    assert len(jit.warmups) == 1
    launch((5, 2, 1), (3, 4, "c"), key="k", num_warps=4)
    assert not jit.launches and len(compiled.launches) == 1  # straight to the compiled kernel
