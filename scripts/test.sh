#!/usr/bin/env bash
# The test suite (fast unit tests and the slow end-to-end ones).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
bash scripts/setup_browser.sh  # chromium + chromedriver for the chat page's browser test
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# One pytest-xdist worker per core (at most FXCOMPILER_TEST_WORKERS, default 2); a module's
# tests stay on one worker so its module-scoped models are built once.
workers=${FXCOMPILER_TEST_WORKERS:-2}
cores=$(nproc 2>/dev/null || echo 1)
if [ "$cores" -lt "$workers" ]; then workers=$cores; fi
if [ "$workers" -gt 1 ]; then
  exec .venv/bin/python -m pytest -q -n "$workers" --dist loadscope --durations=30 "$@"
fi
exec .venv/bin/python -m pytest -q --durations=30 "$@"
