"""Registers, stack and shared memory of the attention kernel variants `proxima serve` runs, built
for sm_90 here.

Why: a kernel variant that spills or passes 255 registers runs slower on the H200 without any test
failing on CPU, and one that needs more than the GPU's 227 KiB of shared memory fails to launch.
Triton and its bundled ptxas compile for a GPU target without a GPU, so this builds the served
variants (decode-only and mixed plans, unsplit and split, bf16, fp8, int8 and int4 caches; Llama-3-8B
attention shapes) the way a launch specialises them, reads each cubin's resource usage with the
bundled cuobjdump and each build's shared memory from Triton. Measured on the H200, 168 registers are
where a decode program fits three to an SM (docs/benchmarks.md); fp16 dots in the mixed plan's long
tiles took it to 255 and spilled.

With `--loop-ops`, also each variant's two largest loops in SASS (a KV tile loop each: in a mixed
variant the long tiles' and the short, decode tiles'): their instructions a thread and the kinds
that cost (shared-memory traffic and barriers, integer moves, tensor-core ops); per-tile work is
that times the warps.

usage: python scripts/kernel_resources.py [--json] [--fp8-decode-tiles] [--loop-ops]
                                          [--int4-rotation butterfly|matrix] [--[no-]int4-prefetch]
       (TRITON_INTERPRET must be unset)
Run by tests/test_kernel_resources.py, in a subprocess of its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from proxima.engine.attention import gluon_int4_decode as gd
from proxima.engine.attention import launch_args
from proxima.engine.attention import triton_attention as ta
from proxima.engine.attention.planning import TileConfig, cache_tiles, choose_tiles

HQ, HKV, D = 32, 8, 128
TARGET = GPUTarget("cuda", 90, 32)
_UNSPLIT_WS = ("stride_acc_t", "stride_acc_h", "stride_acc_s", "stride_ml_t", "stride_ml_h")


def _variant(cache: str, tiles: TileConfig, split: bool, head_size: int = D,
             model: str = "bf16") -> tuple[dict, dict]:
    """Pointer dtypes and constexprs of ``_slot_attention_kernel`` as a launch with these tiles
    specialises it, for a ``bf16``, ``fp8e4nv``, ``int8`` (per-token-head codes) or ``int4`` (its
    codes read as int32 words, unpacked with inline PTX as on the GPU) cache; dot dtypes as
    ``launch_args.dot_dtype``."""
    fp8 = cache == "fp8e4nv"
    codes = {"int8": 1, "int4": 2}.get(cache, 0)
    group = HQ // HKV
    const = dict(HEAD_SIZE=head_size, HEAD_SIZE_PAD=head_size, GROUP=group, BLOCK_Q=tiles.block_m // group,
                 BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, SHORT_BLOCK_M=tiles.short_block_m,
                 SHORT_BLOCK_N=tiles.short_block_n,
                 DOT_DTYPE=tl.float16 if fp8 and not tiles.short_block_m else tl.bfloat16,
                 SHORT_DOT_DTYPE=tl.float16 if fp8 else tl.bfloat16,
                 DOT_PRECISION="tf32", SPLIT=split, QUANT=fp8, SCALE_STRIDE=0, FP8_MAX=448.0 if fp8 else 0.0,
                 DENSE_KV=False, KV_CODES=codes, ROT_DTYPE=tl.bfloat16, INT4_PTX=codes == 2,
                 ROT_BUTTERFLY=codes == 2 and launch_args.INT4_ROTATION == "butterfly",
                 INT4_PREFETCH=codes == 2 and launch_args.INT4_PREFETCH, ROLE=0)
    if model == "fp32":  # a float32 model: float32 dots in 3xTF32, as launch_args.dot_dtype
        const |= dict(DOT_DTYPE=tl.float32, SHORT_DOT_DTYPE=tl.float32, DOT_PRECISION="tf32x3",
                      ROT_DTYPE=tl.float32)
    code = {"int8": "i8", "int4": "i32"}.get(cache, cache)
    ptrs = {"k_ptr": code, "v_ptr": code, "slot_table_ptr": "i32", "query_start_loc_ptr": "i32",
            "seq_lens_ptr": "i32", "acc_ws_ptr": "fp32", "m_ws_ptr": "fp32", "l_ws_ptr": "fp32",
            "k_scale_ptr": "fp32" if fp8 or codes else cache,
            "v_scale_ptr": "fp32" if fp8 or codes else cache,
            "rht_ptr": "fp32" if codes == 2 else "bf16", "signs_ptr": "fp32" if codes == 2 else "bf16",
            "longest_query_ptr": "i32",
            "q_ptr": model, "out_ptr": model}
    return ptrs, const


def variants() -> list[tuple[str, dict, dict, TileConfig]]:
    """(name, pointer dtypes, constexprs, tiles) of each served variant of ``_slot_attention_kernel``,
    and of the mixed plan with dense-tile reads (``TileConfig.dense_kv``), not yet served."""
    out = []
    for cache in ("bf16", "fp8e4nv", "int8", "int4"):
        for plan, max_query_len in (("decode", 1), ("mixed", None)):
            tiles = cache_tiles(HQ // HKV, D, 2, max_query_len, cache == "int4")
            for split in (False, True):
                ptrs, const = _variant(cache, tiles, split)
                name = f"{plan} {'fp8' if cache == 'fp8e4nv' else cache}{' split' if split else ''}"
                out += _launches(name, ptrs, const, tiles)
                if plan == "mixed" and cache == "int4":  # on the GPU its decodes go to the Gluon kernel
                    out.append((name.replace("mixed", "mixed long"), ptrs,
                                const | {"ROLE": 2, "SHORT_BLOCK_M": gd.ROWS_OUT}, tiles))
                if plan == "mixed" and cache == "bf16":  # the dense-tile reads, not served yet
                    desc = f"tensordesc<bf16[{tiles.block_n},{D}]>"
                    out.append((name.replace("mixed", "mixed dense"), ptrs | {"k_desc": desc, "v_desc": desc},
                                const | {"DENSE_KV": True}, tiles))
    # int4 at head 256 in float32 (not served by the 8B shapes above, but by a float32 model with wide
    # heads): the variant whose 128-token tiles needed more shared memory than the H200 has.
    for plan, max_query_len in (("decode", 1), ("mixed", None)):
        tiles = cache_tiles(HQ // HKV, 256, 4, max_query_len, True)
        ptrs, const = _variant("int4", tiles, False, head_size=256, model="fp32")
        out += _launches(f"{plan} int4 fp32 d256", ptrs, const, tiles)
    return out


def gluon_variants() -> list[tuple[str, dict, dict, int]]:
    """(name, pointer dtypes, constexprs, warps) of ``gluon_int4_decode``'s served variants: the int4
    decode kernel, unsplit and split, at head 128 (Llama-3-8B; the three prefetch depths
    ``prefetch_for`` takes, and two tiles a step, timed and not served) and 64
    (SmolLM2-135M, GQA 3)."""
    from triton.experimental.gluon import language as gl

    ptrs = {"kv_ptr": "i32", "slot_table_ptr": "i32", "query_start_loc_ptr": "i32", "seq_lens_ptr": "i32",
            "acc_ws_ptr": "fp32", "m_ws_ptr": "fp32", "l_ws_ptr": "fp32", "signs_ptr": "fp32",
            "q_ptr": "bf16", "out_ptr": "bf16"}
    out = []
    for head_size, group, prefetch, step in ((D, HQ // HKV, 2, 1), (D, HQ // HKV, 1, 1), (D, HQ // HKV, 0, 1),
                                             (D, HQ // HKV, 0, 2), (64, 3, 2, 1)):
        for split in (False, True):
            layouts = gd.layouts(gd.NUM_WARPS, head_size)
            const = dict(HEAD_SIZE=head_size, GROUP=group, SPLIT=split, DOT_DTYPE=gl.bfloat16,
                         WIDE_OFFSETS=False, PREFETCH=prefetch, STEP=step,
                         **layouts)
            depth = (f" pf{prefetch}" if prefetch < 2 else "") + (f" x{step}" if step > 1 else "")
            name = (f"gluon decode int4{' d64' if head_size == 64 else ''}{depth}"
                    f"{' split' if split else ''}")
            out.append((name, ptrs, const, gd.NUM_WARPS))
    return out


def build_gluon(ptrs: dict, const: dict, num_warps: int):
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = gd._int4_decode_kernel
    signature, aligned = {}, []
    for i, arg in enumerate(fn.arg_names):
        if arg in const:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = "*" + ptrs[arg]
            aligned.append(i)
        elif arg == "qk_scale":
            signature[arg] = "fp32"
        else:
            signature[arg] = "i32"
            if arg.startswith("stride") and arg not in ("stride_ml_t", "stride_ml_h"):
                aligned.append(i)  # 8 KV heads of 34-word records: 272 words a slot
    src = GluonASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                         attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    options = gd.launch_options(const.get("STEP", 1)) | {"num_warps": num_warps}
    return triton.compile(src, target=TARGET, options=options)


def _launches(name: str, ptrs: dict, const: dict, tiles: TileConfig) -> list:
    """The plan's launch variants: one, or a mixed plan's two (``TileConfig.short_launch``: the
    short requests' launch with its own warps, and the long one's), named by role."""
    if tiles.short_launch is None:
        return [(name, ptrs, const, tiles)]
    return [(f"{name} short", ptrs, const | {"ROLE": 1}, tiles.short_launch),
            (f"{name} long", ptrs, const | {"ROLE": 2}, tiles)]


def fp8_decode_tile_variants() -> list[tuple[str, dict, dict, TileConfig]]:
    """The fp8 mixed plan (what FULL graphs replay for decodes) with each decode tile shape that
    ``scripts/gpu/sweep_fp8_decode.py`` times, unsplit and split: which of them spill."""
    served = choose_tiles(HQ // HKV, D, 2, None)
    out = []
    for n in (64, 128, 256):
        for warps, stages in ((4, 2), (4, 3), (4, 4), (8, 3), (8, 4)):
            tiles = dataclasses.replace(served, short_block_n=n, num_warps=warps, num_stages=stages)
            for split in (False, True):
                ptrs, const = _variant("fp8e4nv", tiles, split)
                name = f"fp8 decode n{n} w{warps} s{stages}{' split' if split else ''}"
                out.append((name, ptrs, const, tiles))
    return out


def build(ptrs: dict, const: dict, tiles):
    fn = ta._slot_attention_kernel
    signature, aligned = {}, []
    for i, arg in enumerate(fn.arg_names):
        if arg in const:
            signature[arg] = "constexpr"
        elif arg.endswith("_desc"):  # a descriptor, or the cache standing in for one
            signature[arg] = ptrs.get(arg, "*" + ptrs["k_ptr"])
            if not signature[arg].startswith("tensordesc"):
                aligned.append(i)
        elif arg.endswith("_ptr"):
            signature[arg] = "*" + ptrs.get(arg, "bf16")
            aligned.append(i)
        elif arg == "qk_scale":
            signature[arg] = "fp32"
        else:
            signature[arg] = "i32"
            # Strides of real tensors are multiples of 16 here (Triton specialises on it); the
            # m/l workspace strides are not specialised (the kernel's do_not_specialize).
            if arg.startswith("stride") and arg not in ("stride_ml_t", "stride_ml_h"):
                aligned.append(i)
    src = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    options = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    return triton.compile(src, target=TARGET, options=options)


LOOP_OPS = ("HGMMA", "HMMA", "LDS", "LDSM", "STS", "BAR", "LDG", "IMAD", "LOP3", "SHF", "PRMT", "SHFL",
            # The rest of a register-only loop's work: moves, addressing, the softmax's arithmetic.
            "MOV", "IADD3", "ISETP", "LEA", "FMUL", "FFMA", "MUFU")


def _cuobjdump(kernel, flag: str) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(kernel.asm["cubin"])
        return subprocess.run([str(tool), flag, str(path)], capture_output=True, text=True, check=True).stdout


def resources(kernel) -> dict[str, int]:
    """Registers and stack (from the cubin) and shared memory (Triton's launch needs it, and fails
    past the GPU's 227 KiB: no CPU test would notice otherwise) of one compiled variant."""
    text = _cuobjdump(kernel, "-res-usage")
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{text}")
    return {"registers": int(found[1]), "stack_bytes": int(found[2]), "shared_bytes": kernel.metadata.shared}


def loop_ops(kernel, rank: int = 0) -> dict[str, int]:
    """Instructions of the compiled variant's ``rank``-th largest loop (0: the largest; a loop runs
    from a backward branch to its target), by opcode (LOOP_OPS and the total); {"total": 0} when
    there is no such loop."""
    sass = _cuobjdump(kernel, "-sass")
    code = [(int(m[1], 16), m[2]) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = sorted(((at - int(t[1], 16), int(t[1], 16), at) for at, ins in code
                    if "BRA" in ins and (t := re.search(r"0x([0-9a-f]+)", ins)) and int(t[1], 16) < at),
                   reverse=True)
    if len(loops) <= rank:
        return {"total": 0}
    _, start, end = loops[rank]
    ops: dict[str, int] = {}
    for at, ins in code:
        op = re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", ins)
        if start <= at <= end and op:
            ops[op[1]] = ops.get(op[1], 0) + 1
    return {k: ops.get(k, 0) for k in LOOP_OPS} | {"total": sum(ops.values())}


def _triton_variants(fp8_decode_tiles: bool) -> list[tuple[str, dict, dict, TileConfig]]:
    return fp8_decode_tile_variants() if fp8_decode_tiles else variants()


def _row(job: tuple[str, int], fp8_decode_tiles: bool, with_loops: bool) -> tuple[str, dict]:
    """One variant built and measured (in a worker process): the job names its list and index."""
    kind, index = job
    if kind == "gluon":
        name, ptrs, const, warps = gluon_variants()[index]
        kernel = build_gluon(ptrs, const, warps)
        # The loop's barriers are the kernel's reason to be: always reported.
        return name, resources(kernel) | {"warps": warps, "loop": loop_ops(kernel)}
    name, ptrs, const, tiles = _triton_variants(fp8_decode_tiles)[index]
    kernel = build(ptrs, const, tiles)
    row = resources(kernel) | {"warps": tiles.num_warps}
    if with_loops:
        row["loop"] = loop_ops(kernel)
        if tiles.short_block_m and tiles.short_launch is None:  # one launch: the decode tiles' loop too
            row["loop2"] = loop_ops(kernel, 1)
    return name, row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--fp8-decode-tiles", action="store_true",
                   help="instead: the fp8 mixed plan with each decode tile shape the fp8 sweep times")
    p.add_argument("--loop-ops", action="store_true", help="also the KV tile loop's instructions by kind")
    p.add_argument("--int4-rotation", choices=("butterfly", "matrix"), default=launch_args.INT4_ROTATION,
                   help="how int4 variants rotate (launch_args.INT4_ROTATION; default: the served one)")
    p.add_argument("--int4-prefetch", action=argparse.BooleanOptionalAction,
                   default=launch_args.INT4_PREFETCH,
                   help="whether int4 decode tiles pipeline their loads (launch_args.INT4_PREFETCH)")
    args = p.parse_args()
    launch_args.INT4_ROTATION = args.int4_rotation
    launch_args.INT4_PREFETCH = args.int4_prefetch
    if os.environ.get("TRITON_INTERPRET"):
        print("kernel_resources: unset TRITON_INTERPRET (the interpreter builds nothing)", file=sys.stderr)
        return 2
    jobs = [("triton", i) for i in range(len(_triton_variants(args.fp8_decode_tiles)))]
    if not args.fp8_decode_tiles:
        jobs = [("gluon", i) for i in range(len(gluon_variants()))] + jobs
    # Each build is one ptxas run on one core: built side by side, one process a core (forked, so
    # each inherits the launch_args settings above).
    with ProcessPoolExecutor(os.cpu_count() or 1, mp_context=multiprocessing.get_context("fork")) as pool:
        rows = dict(pool.map(partial(_row, fp8_decode_tiles=args.fp8_decode_tiles, with_loops=args.loop_ops),
                             jobs))
    if args.json:
        print(json.dumps(rows))
    else:
        width = max(map(len, rows))
        for name, r in rows.items():
            print(f"{name:<{width}} registers {r['registers']:>3}  stack {r['stack_bytes']:>4} B"
                  f"  shared {r['shared_bytes'] >> 10:>3} KiB"
                  + "".join(f"  {key} " + " ".join(f"{k} {v}" for k, v in r[key].items())
                            + f" (x{r['warps']} warps)" for key in ("loop", "loop2") if key in r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
