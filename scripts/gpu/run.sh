#!/usr/bin/env bash
# On the GPU machine (after .gpu-bundle/device.sh install): kernel tests, decode microbenchmark,
# end-to-end A/B. Logs and JSON go to $OUT.
# usage: bash scripts/gpu/run.sh {kernels|mixed|guard|sweep|sweep-fp8|sweep-prefill|prefill-stages|prefix|e2e|fp8|
#                                 e2e-fp8|pth|sweep-pth|sweep-pth-tiles|gluon-int4|e2e-pth}
#        [e2e options: --only NAME,... --profile]
set -uo pipefail
source /tmp/gpu-env
# PROXIMA_TREE=DIR: run another tree's proxima package (e.g. `git archive main proxima` unpacked
# there) with this tree's scripts, for an A/B in one session.
[[ -n ${PROXIMA_TREE:-} ]] && export PYTHONPATH=$(realpath "$PROXIMA_TREE"):$PYTHONPATH
out=${OUT:-/tmp/out}
# bench SCRIPT NAME: run scripts/gpu/SCRIPT.py, its JSON to $out/NAME.json and its report to $out/NAME.txt.
bench() {
  python3 "scripts/gpu/$1.py" --json "$out/$2.json" 2>&1 | grep -v Warning | tee "$out/$2.txt"
}
case ${1:-} in
kernels)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -m pytest -q -p no:cacheprovider tests/test_attention_kernels.py tests/test_attention_splitkv.py \
    tests/test_attention_gpu_shapes.py tests/test_attention_gpu_graphs.py tests/test_kernel_launch.py \
    -k "triton or split or launch or graph or precompiled" 2>&1 | tail -5 | tee "$out/kernel-tests.txt"
  bench bench_decode decode
  ;;
mixed) bench bench_mixed mixed ;;
guard)  # decode grid (bf16, fp8, int4), mixed and prefill cases as ratios in this run; exit 1 past 10% worse
  python3 scripts/gpu/bench_fp8.py --json "$out/guard-fp8.json" >/dev/null 2>&1
  python3 scripts/gpu/bench_pth.py --json "$out/guard-pth.json" >/dev/null 2>&1
  python3 scripts/gpu/bench_mixed.py --json "$out/guard.json" --include "$out/guard-fp8.json" \
    --include "$out/guard-pth.json" \
    --guard scripts/gpu/attention_ratios.json 2>&1 | grep -v Warning | tee "$out/guard.txt"
  exit "${PIPESTATUS[0]}"
  ;;
fp8)  # fp8 KV kernel tests, then decode under graph replay: Proxima fp8 vs FA3 fp8 (and both bf16)
  python3 -m pytest -q -p no:cacheprovider tests/test_attention_fp8.py 2>&1 | tail -5 \
    | tee "$out/fp8-kernel-tests.txt"
  bench bench_fp8 fp8-decode
  ;;
pth)  # per-token-head KV kernel tests, then decode under graph replay: Proxima vs FA3 bf16 and stock int4/int8
  python3 -m pytest -q -p no:cacheprovider tests/test_attention_per_token_head.py -k "triton or torch" 2>&1 \
    | tail -5 | tee "$out/pth-kernel-tests.txt"
  bench bench_pth pth-decode
  ;;
sweep-pth) bench sweep_pth_decode sweep-pth ;;  # launch plans of graph-replayed decode, bf16 and int4
sweep-pth-tiles) bench sweep_pth_tiles sweep-pth-tiles ;;  # int4 decode tile shapes, graph-replayed
gluon-int4)  # the Gluon int4 decode kernel: its output, then its decode grid against FA3 bf16 and Triton's
  bench gluon_int4 gluon-int4
  python3 -m pytest -q -p no:cacheprovider tests/test_attention_gluon_int4.py 2>&1 | tail -5 \
    | tee "$out/gluon-int4-tests.txt"
  ;;
e2e-pth)  # the 1 GiB budget with int4 KV: Proxima vs stock int4 vs stock defaults (pass --shared-prefix 300, or 0,300 for both bursts in one engine)
  shift
  python3 scripts/gpu/llama8b_dummy.py /tmp/llama8b >/dev/null
  python3 scripts/gpu/e2e.py /tmp/llama8b "$out/e2e-pth" --no-tiles "$@" 2>&1 | tee -a "$out/e2e-pth.txt"
  ;;
e2e-fp8)  # the 1 GiB budget with fp8 KV (and the bf16 pair for reference), greedy fp8 on seeded weights
  shift
  python3 scripts/gpu/llama8b_dummy.py /tmp/llama8b >/dev/null
  python3 scripts/gpu/e2e.py /tmp/llama8b "$out/e2e-fp8" --only \
    stock-fa3-1g-fp8-full,proxima-1g-fp8-full,stock-fa3-1g-fp8,proxima-1g-fp8,stock-fa3-1g-full,\
proxima-1g-full,stock-triton-seeded-fp8,stock-fa3-seeded-fp8,proxima-seeded-fp8,proxima-seeded "$@" \
    2>&1 | tee "$out/e2e-fp8.txt"
  ;;
sweep) bench sweep_decode sweep ;;
sweep-fp8) bench sweep_fp8_decode sweep-fp8 ;;  # fp8 decode shapes at the points furthest from FA3 fp8
sweep-prefill) bench sweep_prefill sweep-prefill ;;
prefill-stages)
  python3 scripts/gpu/prefill_stages.py 2>&1 | grep -v Warning | tee "$out/prefill-stages.txt"
  ;;
prefix)
  shift
  python3 scripts/gpu/llama8b_dummy.py /tmp/llama8b >/dev/null
  python3 scripts/gpu/prefix_bench.py /tmp/llama8b "$out" "$@" 2>&1 | grep -v -i warning | tee "$out/prefix.txt"
  (cd "$out" && tar czf prefix-bench.tgz bench-* logs && rm -rf bench-* logs)
  ;;
e2e)
  shift
  python3 scripts/gpu/llama8b_dummy.py /tmp/llama8b >/dev/null
  python3 scripts/gpu/e2e.py /tmp/llama8b "$out/e2e" "$@" 2>&1 | tee "$out/e2e.txt"
  ;;
*) echo "usage: run.sh kernels|mixed|guard|sweep|sweep-fp8|sweep-prefill|prefill-stages|prefix|e2e|fp8|e2e-fp8|pth|sweep-pth|sweep-pth-tiles|e2e-pth" >&2
   exit 2 ;;
esac
