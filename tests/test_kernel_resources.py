"""The served attention kernel variants, built for sm_90 on this CPU (scripts/kernel_resources.py),
use no more registers and stack than recorded: a change that makes one spill or lose occupancy on
the H200 fails here, before any GPU run. Ceilings are the builds of the pinned Triton 3.6."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# name -> (registers, stack bytes). 168 registers fit a decode program three to an SM. The one
# spill, "mixed fp8 split" (fp16 dots on its decode tiles), ran faster on the H200 than the same
# variant without it with bf16 dots (15.2 against 17.7 us at 1 x 2,048; docs/benchmarks.md, fp8).
CEILINGS = {
    "decode bf16": (168, 0), "decode bf16 split": (168, 0),
    "mixed bf16": (212, 0), "mixed bf16 split": (210, 0),
    "decode fp8": (207, 0), "decode fp8 split": (207, 0),
    "mixed fp8": (214, 0), "mixed fp8 split": (255, 16),
    # Dense-tile reads (TileConfig.dense_kv), built though not planned yet, so that the GPU session
    # that times them starts from variants without spills.
    "mixed dense bf16": (255, 0), "mixed dense bf16 split": (211, 0),
    # Per-token-head codes. int8 takes the bf16 plan's tiles (its mixed variant spills 16 B, as
    # when the H200 timed it at 0.96-1.10x stock int8); int4 16 x 128 tiles, one stage
    # (planning._pth_tiles), unpacking nibbles in-kernel and rotating by butterflies (no stack: the
    # matrix rotation's dots spilled 16 B in the mixed plan, 88 B once the decode tiles kept their
    # sums per token). Decode tiles pipeline their loads (launch_args.INT4_PREFETCH 1): 24 B of
    # stack in the mixed plan, which still ran fastest on the H100 (docs/benchmarks.md, issue 25);
    # a bf16 model's decode-only int4 batches take that plan too (planning.cache_tiles).
    "decode int8": (228, 0), "decode int8 split": (214, 0),
    "mixed int8": (255, 16), "mixed int8 split": (244, 0),
    "decode int4": (255, 24), "decode int4 split": (255, 0),
    "mixed int4": (255, 24), "mixed int4 split": (255, 0),
    # The served int4 plan on the GPU: the unified kernel takes the longer queries (its decodes go
    # to the Gluon kernel below), the Gluon kernel the decodes: two tiles of loads in flight
    # (PREFETCH 2) and no stack, split or not; one tile (pf1, the larger batches) in 167, three
    # programs an SM (gluon_int4_decode.prefetch_for); none (pf0, unsplit launches of 397-528
    # programs) in 128 or fewer unsplit, four an SM; two tiles a softmax update (pf0 x2, timed,
    # not served) capped at 168 (gluon_int4_decode.launch_options) with no stack: three an SM.
    "mixed long int4": (255, 16), "mixed long int4 split": (244, 0),
    "gluon decode int4": (227, 0), "gluon decode int4 split": (227, 0),
    "gluon decode int4 pf1": (167, 0), "gluon decode int4 pf1 split": (167, 0),
    "gluon decode int4 pf0": (128, 0), "gluon decode int4 pf0 split": (152, 0),
    "gluon decode int4 pf0 x2": (168, 0), "gluon decode int4 pf0 x2 split": (168, 0),
    "gluon decode int4 d64": (128, 0), "gluon decode int4 d64 split": (134, 0),
    # A float32 model at head 256: correct first (its 128-token tiles needed 288 KiB of shared
    # memory and failed to launch on the H200); the spills are that rare shape's cost.
    "decode int4 fp32 d256": (255, 2416), "mixed int4 fp32 d256": (255, 2416),
}
SHARED_MEMORY_LIMIT = 227 * 1024  # what one H100/H200 program may use; more fails at launch


@pytest.fixture(scope="module")
def measured() -> dict[str, dict[str, int]]:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_resources.py"), "--json"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout)


def test_every_variant_is_built(measured) -> None:
    assert set(measured) == set(CEILINGS)


@pytest.mark.parametrize("name", list(CEILINGS))
def test_variant_stays_within_its_registers_and_stack(measured, name: str) -> None:
    registers, stack = CEILINGS[name]
    assert measured[name]["registers"] <= registers, measured[name]
    assert measured[name]["stack_bytes"] <= stack, measured[name]


@pytest.mark.parametrize("name", [n for n in CEILINGS if n.startswith("gluon")])
def test_the_gluon_decode_loop_has_no_barrier_and_no_shared_memory(measured, name: str) -> None:
    """Why the kernel exists (gluon_int4_decode's docstring): its warps never wait for each other
    inside the KV tile loop, and its dots read every operand from registers (mma.sync)."""
    loop = measured[name]["loop"]
    assert loop["BAR"] == loop["STS"] == loop["LDS"] == loop["LDSM"] == 0, loop
    assert loop["HMMA"] > 0 and loop["HGMMA"] == 0, loop


@pytest.mark.parametrize("name", list(CEILINGS))
def test_variant_fits_the_gpus_shared_memory(measured, name: str) -> None:
    assert measured[name]["shared_bytes"] <= SHARED_MEMORY_LIMIT, measured[name]
