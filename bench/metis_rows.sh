#!/usr/bin/env bash
# The three rows of ImprovedMetis's Table 1 that finish in minutes (global batch 128), searched
# in Metis's space and in the union under Metis's cost model. Prints one line per run:
# row, space, best cost (ms), plans costed, partial plans, proven, whole-process CPU s, wall s, peak RSS.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/motley}
M=examples/metis
printf "%-14s %-6s %10s %10s %12s %6s %8s %8s %8s\n" row space cost_ms costed nodes proven cpu_s wall_s rss_mb
for row in "10 16" "20 32" "20 64"; do
  set -- $row
  for space in ${SPACES:-metis union}; do
    out=$( { /usr/bin/time -f "TIME %U %S %e %M" "$BIN" metis search --profiles $M/synth_L$1 --hostfile $M/cluster/hostfile_$2 \
      --clusterfile $M/cluster/clusterfile.json --layers $1 --global-batch 128 --space $space -o json; } 2>&1 )
    echo "$out" | python3 -c "
import json,sys
t=sys.stdin.read(); j=t[:t.rindex('TIME')]; u,s,e,m=t[t.rindex('TIME'):].split()[1:]
d=json.loads(j)
print('%-14s %-6s %10.2f %10d %12d %6s %8.3f %8.2f %8.1f' % ('L$1 $2+$2','$space',d['cost_ms'],d['plans_costed'],d['nodes'],d['proven_optimal'],float(u)+float(s),float(e),int(m)/1024))"
  done
done
