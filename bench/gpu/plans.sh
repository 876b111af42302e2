#!/usr/bin/env bash
# The plans python/gpu-check --plan runs on a one-GPU machine: gpu-check's llama (bench/gpu/
# gpu-check-llama.json, the model gpu_check.MODEL) on one H100-class GPU, in bf16 and fp32, with
# and without ZeRO-1 (dp 1: a master copy beside bf16 weights), micro-batches 4 and 8.
#   bench/gpu/plans.sh OUT_DIR     (needs target/ci/motley or $MOTLEY_BIN)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:?usage: bench/gpu/plans.sh OUT_DIR}"
bin="${MOTLEY_BIN:-$here/../../target/ci/motley}"
mkdir -p "$out"
model="$out/gpu-check-llama.json"
PYTHONPATH="$here/../../python" python3 -c 'import json, sys; from motley_torch.tools.gpu_check import MODEL; json.dump(MODEL, open(sys.argv[1], "w"))' "$model"
for precision in bf16 fp32; do
  for mb in 4 8; do
    for z in "" "--zero1"; do
      name="$precision-mb$mb${z:+-zero1}"
      "$bin" plan --cluster "$here/one-h100.yaml" --model "$model" --global-batch 16 --micro-batch "$mb" \
        --precision "$precision" $z -o json > "$out/$name.json"
      echo "$out/$name.json"
    done
  done
done
