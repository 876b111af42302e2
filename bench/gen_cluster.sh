#!/usr/bin/env bash
# Writes a cluster of N GPUs of three types (A100-80G and H800 on one InfiniBand fabric,
# V100-32G on RoCE in another domain) to stdout. Usage: bench/gen_cluster.sh N
set -euo pipefail
n=$1
if [ "$n" -ge 48 ]; then gpn=8; else gpn=$(( n / 4 )); [ "$gpn" -ge 1 ] || gpn=1; fi
nodes=$(( n / gpn ))
a=$(( (nodes + 2) / 3 )); h=$(( (nodes + 1) / 3 )); v=$(( nodes / 3 ))
echo "name: gen-$n"
echo "nodes:"
emit() { # name gpu count nic domain
  [ "$3" -gt 0 ] || return 0
  cat <<YAML
  - name: $1
    count: $3
    gpu: $2
    gpus: $gpn
    nics:
      - {name: mlx5_0, kind: $4, gbps: 200}
      - {name: eth0, kind: ethernet, gbps: 25}
    rdma_domain: $5
YAML
}
emit a100 A100-80G "$a" ib dc1
emit h800 H800 "$h" ib dc1
emit v100 V100-32G "$v" roce dc2
