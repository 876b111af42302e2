#!/usr/bin/env bash
# What a session with one lent GPU runs, in one go, writing everything under OUT (default
# ./gpu-out): the environment, the CUDA tests, bench/gpu/mfu.py (Motley beside the baseline) and
# python/gpu-check. Each part has its own time limit so a slow one cannot eat the others' (60 +
# 300 + 240 s at most: one device call of 600 s; gpu-check compiles its blocks once per precision).
#   bench/gpu/session.sh [OUT]      (MFU_VARIANTS, MFU_MODELS, GPU_CHECK_STEPS, GPU_CHECK_PRECISIONS,
#                                    GPU_CHECK_CHECKS override)
# GPU_PLANS=DIR: gpu-check also runs every plan DIR holds against its memory_gib_per_gpu (make
# them here with bench/gpu/plans.sh DIR: the GPU machine has no motley binary). gpu-check prints
# a `gpu-check row` line per check to gpu-check.err as it finishes, so a bound cuts no result.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="${1:-${OUT:-$repo/gpu-out}}"
mkdir -p "$out"
# Carried wheels (pytest, pyyaml) where the GPU machine lacks them: nothing can be fetched there.
export PYTHONPATH="$repo/python${GPU_DEPS:+:$GPU_DEPS}${PYTHONPATH:+:$PYTHONPATH}"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'
  command -v gcc cc || echo "no C compiler"
  nproc
} > "$out/env.txt" 2>&1
cd "$repo"
timeout 60 python3 -m pytest -q -p no:cacheprovider python/tests/test_head_loss.py python/tests/test_runtime_speed.py -k "not compiled_blocks and not mfu_is_reported and not flags" > "$out/tests.txt" 2>&1
echo "tests rc=$?" >> "$out/tests.txt"
timeout "${MFU_TIMEOUT:-300}" python3 bench/gpu/mfu.py -o json --models "${MFU_MODELS:-gpu-check,llama-1b}" \
  --variants "${MFU_VARIANTS:-motley,baseline,motley-eager}" > "$out/mfu.json" 2> "$out/mfu.err"
echo "mfu rc=$?" >> "$out/mfu.err"
plans=()
if [ -n "${GPU_PLANS:-}" ]; then
  for f in "$GPU_PLANS"/*.json; do
    [ "$(basename "$f")" = gpu-check-llama.json ] || plans+=(--plan "$f")  # plans.sh's model file
  done
fi
timeout "${GPU_CHECK_TIMEOUT:-240}" python/gpu-check -o json --steps "${GPU_CHECK_STEPS:-8}" \
  --precisions "${GPU_CHECK_PRECISIONS:-bf16,fp16}" --checks "${GPU_CHECK_CHECKS:-train,nccl,profile,multi-gpu,memory}" \
  "${plans[@]}" > "$out/gpu-check.json" 2> "$out/gpu-check.err"
echo "gpu-check rc=$?" >> "$out/gpu-check.err"
