#!/usr/bin/env bash
# Planning time and plan quality from 8 to 4096 GPUs of three types, whole process.
# Usage: bench/scale.sh [model] [runs]    (builds the release binary first)
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-llama-13b}
runs=${2:-5}
cargo build --release -q -p motley
bin=target/release/motley
tmp=$(mktemp -d)
echo "| GPUs | global batch | median wall s | max CPU s (user+sys) | max RSS MiB | search | plans costed | iteration s | vs megatron | vs whale | gap bound vs fluid LB |"
echo "|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"
for n in 8 16 32 64 128 256 512 1024 2048 4096; do
  bench/gen_cluster.sh "$n" > "$tmp/c.yaml"
  gb=$(( n > 256 ? n : 256 ))
  walls=(); cpu=0; rss=0
  for _ in $(seq "$runs"); do
    /usr/bin/time -f "%e %U %S %M" -o "$tmp/t" "$bin" plan --cluster "$tmp/c.yaml" --model "$model" --global-batch "$gb" -o json > "$tmp/out.json"
    read -r e u s m < "$tmp/t"
    walls+=("$e")
    cpu=$(python3 -c "print(max($cpu, $u + $s))")
    rss=$(( m > rss ? m : rss ))
  done
  med=$(printf '%s\n' "${walls[@]}" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
  python3 - "$tmp/out.json" "$n" "$gb" "$med" "$cpu" "$rss" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); n, gb, med, cpu, rss = sys.argv[2:7]
b = d["baselines"]; s = d["search"]
f = lambda x: f"{x:.2f}x" if x else "n/a"
lb = s.get("lower_bound")
gap = f"{(d['iteration_time_s'] / lb - 1) * 100:.1f}%" if lb else ("0 (proven)" if s["proven_optimal"] else "n/a")
print(f"| {n} | {gb} | {float(med):.3f} | {float(cpu):.2f} | {int(rss)/1024:.0f} | {s['mode']} | {s['plans_costed']} | {d['iteration_time_s']:.3f} | {f(b['megatron']['speedup'])} | {f(b['whale']['speedup'])} | {gap} |")
PY
done
rm -rf "$tmp"
