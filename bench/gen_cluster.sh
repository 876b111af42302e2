#!/usr/bin/env bash
# Writes a cluster of N GPUs of three types to stdout: A100-80G and H800 nodes on one
# InfiniBand fabric (4 x 200 Gbit/s rails), V100-32G nodes on RoCE (2 x 100 Gbit/s) in another
# RDMA domain, 25 Gbit/s Ethernet everywhere. Nodes have 8 GPUs from 48 GPUs up, fewer below.
# Usage: bench/gen_cluster.sh N
set -euo pipefail
n=$1
if [ "$n" -ge 48 ]; then gpn=8; else gpn=$(( n / 4 )); [ "$gpn" -ge 1 ] || gpn=1; fi
nodes=$(( n / gpn ))
a=$(( (nodes + 2) / 3 )); h=$(( (nodes + 1) / 3 )); v=$(( nodes / 3 ))
echo "name: gen-$n"
echo "nodes:"
emit() { # name gpu count kind rails gbps domain
  [ "$3" -gt 0 ] || return 0
  printf '  - name: %s\n    count: %s\n    gpu: %s\n    gpus: %s\n    rdma_domain: %s\n    nics:\n' "$1" "$3" "$2" "$gpn" "$7"
  for r in $(seq 0 $(( $5 - 1 ))); do printf '      - {name: mlx5_%s, kind: %s, gbps: %s}\n' "$r" "$4" "$6"; done
  printf '      - {name: eth0, kind: ethernet, gbps: 25}\n'
}
emit a100 A100-80G "$a" ib 4 200 dc1
emit h800 H800 "$h" ib 4 200 dc1
emit v100 V100-32G "$v" roce 2 100 dc2
