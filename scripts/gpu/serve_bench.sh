#!/usr/bin/env bash
# On the GPU machine (after .gpu-bundle/device.sh install): `proxima bench --launch` brings up
# stock vLLM and then `proxima serve` (one at a time, each on the whole GPU) on the 8B-shaped
# dummy model at a 1 GiB KV budget, and sweeps concurrency with the short-chat workload. GPU
# memory comes from NVML. Everything bench writes is packed into $OUT/bench.tgz.
# Plan ~7 minutes: each server compiles and captures graphs for ~1.5 minutes before its levels.
# usage: bash scripts/gpu/serve_bench.sh [extra proxima bench options]
set -uo pipefail
source /tmp/gpu-env
out=${OUT:-/tmp/out}
python3 scripts/gpu/llama8b_dummy.py /tmp/llama8b >/dev/null
rm -rf /tmp/bench
proxima bench --launch /tmp/llama8b --variants stock,token -c 32,128 -n 160 --workload short-chat \
  --slo-p95 20 -o /tmp/bench "$@" -- \
  --load-format dummy --dtype bfloat16 --max-model-len 2048 --kv-cache-memory-bytes 1073741824 \
  --max-num-seqs 512 2>&1 | grep -v -i warning | tee "$out/bench.txt"
tar czf "$out/bench.tgz" -C /tmp bench
