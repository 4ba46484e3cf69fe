#!/usr/bin/env bash
# The whole GPU check, then the GPU bench, in one command bounded to about ten minutes, for a
# session lent a GPU for a short while (scripts/gpu_check.py --all: the kernels' row-exactness,
# every captured bucket against the eager pass, each precision's drafters through CUDA graphs
# against plain decoding and float32 against Hugging Face, the speed check on a random model of
# the default model's shape, then `specserve bench` where the shipped model and the dev
# questions are on the machine). Writes OUT_DIR/check.json, report.md, log.txt and gpu.txt.
#
#   bash scripts/gpu_check.sh OUT_DIR        # on the GPU machine, in the repository root
#
# It needs torch with CUDA, transformers, tokenizers and safetensors only (no gRPC, Ray or
# pydantic: the check imports none of them).
set -o pipefail
OUT=${1:-docs/lab/gpu-graphs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=$(command -v python3 || command -v python)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
'transformers', transformers.__version__)" >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
timeout 580 "$PY" scripts/gpu_check.py --all --device cuda --out-dir "$OUT" --budget-s 500 2>&1 | tee "$OUT/log.txt"
