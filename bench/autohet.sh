#!/usr/bin/env bash
# AutoHet's four settings (examples/), Motley's predicted speedup over the Megatron-LM and
# Whale baselines under one cost model, side by side with the speedups the paper measured.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p motley
echo "| setting | model | motley s/iter | megatron s/iter | whale s/iter | motley vs megatron | paper | motley vs whale | paper | plan time s | proven optimal |"
echo "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"
while read -r cluster model pm pw; do
  start=$(date +%s.%N)
  target/release/motley plan --cluster "examples/$cluster.yaml" --model "$model" -o json > /tmp/autohet.json
  end=$(date +%s.%N)
  python3 - "$cluster" "$model" "$pm" "$pw" "$start" "$end" <<'PY'
import json, sys
c, m, pm, pw, s, e = sys.argv[1:7]
d = json.load(open("/tmp/autohet.json")); b = d["baselines"]
t = d["iteration_time_s"]; bm = b["megatron"]["iteration_time_s"]; bw = b["whale"]["iteration_time_s"]
print(f"| {c} | {m} | {t:.3f} | {bm:.3f} | {bw:.3f} | {bm/t:.2f}x | {pm} | {bw/t:.2f}x | {pw} | {float(e)-float(s):.3f} | {d['search']['proven_optimal']} |")
PY
done <<'LIST'
a100-h800 gpt3-6.7b 1.53x 1.27x
a100x4-h800x2 llama-7b 1.79x 1.51x
a100x1-h20x4 llama-7b 1.44x 1.16x
a100x8-h800x8 gpt3-6.7b 1.53x 1.27x
LIST
