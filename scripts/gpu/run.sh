#!/usr/bin/env bash
# On the GPU machine (after .gpu-bundle/device.sh install): kernel tests, decode microbenchmark,
# end-to-end A/B. Logs and JSON go to $OUT.
# usage: bash scripts/gpu/run.sh {kernels|mixed|sweep|sweep-prefill|e2e} [e2e options: --only NAME,... --profile]
set -uo pipefail
source /tmp/gpu-env
out=${OUT:-/tmp/out}
case ${1:-} in
kernels)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -m pytest -q -p no:cacheprovider tests/test_attention_kernels.py tests/test_attention_splitkv.py \
    tests/test_attention_gpu_shapes.py tests/test_attention_gpu_graphs.py tests/test_launcher.py \
    -k "triton or split or launch or graph or precompiled" 2>&1 | tail -5 | tee "$out/kernel-tests.txt"
  python3 scripts/gpu/bench_decode.py --json "$out/decode.json" 2>&1 | grep -v Warning | tee "$out/decode.txt"
  ;;
mixed)
  python3 scripts/gpu/bench_mixed.py --json "$out/mixed.json" 2>&1 | grep -v Warning | tee "$out/mixed.txt"
  ;;
sweep)
  python3 scripts/gpu/sweep_decode.py --json "$out/sweep.json" 2>&1 | grep -v Warning | tee "$out/sweep.txt"
  ;;
sweep-prefill)
  python3 scripts/gpu/sweep_prefill.py --json "$out/sweep-prefill.json" 2>&1 | grep -v Warning \
    | tee "$out/sweep-prefill.txt"
  ;;
e2e)
  shift
  python3 scripts/gpu/llama8b_dummy.py /tmp/llama8b >/dev/null
  python3 scripts/gpu/e2e.py /tmp/llama8b "$out/e2e" "$@" 2>&1 | tee "$out/e2e.txt"
  ;;
*) echo "usage: run.sh kernels|mixed|sweep|sweep-prefill|e2e" >&2; exit 2 ;;
esac
