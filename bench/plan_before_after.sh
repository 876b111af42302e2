#!/usr/bin/env bash
# Planning time before and after a change, side by side: `motley plan` of two builds run
# alternately (5 runs each) on bench/gen_cluster.sh's 64-, 1024- and 4096-GPU clusters,
# LLaMA-13B. Usage: bench/plan_before_after.sh BEFORE_BIN AFTER_BIN
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 BEFORE_BIN AFTER_BIN (two motley binaries)" >&2; exit 2; }
before=$(realpath "$1"); after=$(realpath "$2")
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
echo "| GPUs | binary | median wall s | median CPU s (user+sys) | max RSS MiB | iteration s |"
echo "|---:|---|---:|---:|---:|---:|"
for n in 64 1024 4096; do
  bench/gen_cluster.sh "$n" > "$tmp/c.yaml"
  gb=$(( n > 256 ? n : 256 ))
  for b in before after; do : > "$tmp/$b"; done
  for i in 1 2 3 4 5; do
    for b in before after; do
      if [ "$b" = before ]; then bin=$before; else bin=$after; fi
      /usr/bin/time -f "%e %U %S %M" -o "$tmp/t" "$bin" plan --cluster "$tmp/c.yaml" --model llama-13b --global-batch "$gb" -o json > "$tmp/$b.json"
      cat "$tmp/t" >> "$tmp/$b"
    done
  done
  for b in before after; do
    python3 - "$tmp/$b" "$tmp/$b.json" "$n" "$b" <<'PY'
import json, statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
wall = statistics.median(float(r[0]) for r in rows); cpu = statistics.median(float(r[1]) + float(r[2]) for r in rows)
rss = max(int(r[3]) for r in rows) / 1024
d = json.load(open(sys.argv[2]))
print(f"| {sys.argv[3]} | {sys.argv[4]} | {wall:.3f} | {cpu:.3f} | {rss:.0f} | {d['iteration_time_s']:.3f} |")
PY
  done
done
rm -rf "$tmp"
