#!/usr/bin/env bash
# Restore memory (BENCHMARKS.md, "Restore memory"): a real motley-agent restores one multi-GB
# checkpoint unit from its own disk tier, told by a fake coordinator
# (agent/examples/restore_memory.rs); prints the agent's peak RSS (VmHWM) and the gaps between
# its heartbeats while the restore ran, one JSON line per run.
#
#   bench/restore_memory.sh [GIB] [RUNS]     # default: a 3 GiB unit, 2 runs
#
# Needs about GIB x 2 of free disk under ${TMPDIR:-/tmp}.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
gib="${1:-3}"
runs="${2:-2}"
cd "$repo"
cargo build -q --profile ci -p motley-agent --bin motley-agent --example restore_memory
for i in $(seq 1 "$runs"); do
    "$repo/target/ci/examples/restore_memory" --agent "$repo/target/ci/motley-agent" \
        --dir "${TMPDIR:-/tmp}/motley-restore-bench" --gb "$gib" --heartbeat-ms 100
done
