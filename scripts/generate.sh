#!/usr/bin/env bash
# The main job: generate on the embedded default model (SmolLM2-135M-Instruct; prompts go through
# its chat template) and print tokens/s. Extra arguments go to `fxcompiler generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
FXCOMPILER_PREBUILD_IN_BACKGROUND=1 bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/fxcompiler generate --chat-template "$@"
