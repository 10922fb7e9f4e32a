"""Which GPUs the NVML readings cover: those CUDA_VISIBLE_DEVICES names, as CUDA would pick them."""

from __future__ import annotations

import pytest

from proxima.gpu import read_gpus, visible_indices

UUIDS = ["GPU-aaaa-1111", "GPU-bbbb-2222", "GPU-cccc-3333"]


@pytest.mark.parametrize(("env", "expected"), [
    (None, [0, 1, 2]),
    ("", []),
    ("1", [1]),
    ("2,0", [2, 0]),
    ("GPU-bbbb", [1]),
    ("0,GPU-cccc-3333", [0, 2]),
    ("1,7,2", [1]),  # CUDA stops at the first entry that names no GPU
    ("0,0", [0]),
])
def test_visible_indices_follow_cuda_visible_devices(env: str | None, expected: list[int]) -> None:
    assert visible_indices(env, UUIDS) == expected


def test_read_gpus_never_raises_without_a_gpu() -> None:
    assert isinstance(read_gpus(), tuple)
