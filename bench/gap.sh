#!/usr/bin/env bash
# The fast search's loss against the exact search on clusters where both finish: the same
# cluster, model and batch, planned with --search exact and --search fast. The default model
# has 12 layers so that the exact search can prove its optimum (column "exact proven").
# Usage: [SIZES="8 12 16 20"] bench/gap.sh [model]
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p motley
model=${1:-examples/wide-12l.yaml}
tmp=$(mktemp -d)
echo "| GPUs | exact s/iter | exact wall s | exact proven | fast s/iter | fast wall s | fast loss |"
echo "|---:|---:|---:|---|---:|---:|---:|"
for n in ${SIZES:-8 12 16 20}; do
  bench/gen_cluster.sh "$n" > "$tmp/c.yaml"
  for mode in exact fast; do
    s=$(date +%s.%N)
    target/release/motley plan --cluster "$tmp/c.yaml" --model "$model" --search "$mode" -o json > "$tmp/$mode.json"
    e=$(date +%s.%N)
    echo "$s $e" > "$tmp/$mode.t"
  done
  python3 - "$tmp" "$n" <<'PY'
import json, sys
tmp, n = sys.argv[1:3]
ex = json.load(open(f"{tmp}/exact.json")); fa = json.load(open(f"{tmp}/fast.json"))
w = lambda m: (lambda a, b: float(b) - float(a))(*open(f"{tmp}/{m}.t").read().split())
te, tf = ex["iteration_time_s"], fa["iteration_time_s"]
print(f"| {n} | {te:.4f} | {w('exact'):.2f} | {ex['search']['proven_optimal']} | {tf:.4f} | {w('fast'):.3f} | {(tf/te-1)*100:+.2f}% |")
PY
done
rm -rf "$tmp"
