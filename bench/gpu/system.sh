#!/usr/bin/env bash
# The whole system on one CUDA machine, in one go: the agent discovers the node through NVML (no
# inventory file), a coordinator on SQLite plans a job on it, and the agent runs the reference
# trainer on the GPU (NCCL, compiled blocks, the plan's precision) with checkpoints to a file://
# cloud; the rank is killed once it has printed 60 steps and the job resumes from its newest
# complete step.
#   bench/gpu/system.sh [OUT]     (MOTLEY_BIN_DIR: motley, motley-coordinator, motley-agent;
#                                  default target/ci; SYSTEM_STEPS: 200; SYSTEM_PYTHON: python3;
#                                  SYSTEM_INVENTORY=FILE: a node entry instead of discovery, to try
#                                  the script on a machine without GPUs, ranks on the CPU;
#                                  SYSTEM_MODEL: the job's model as a YAML flow mapping, default
#                                  gpu-check's llama; SYSTEM_BATCH: its global batch, 32)
# Ranks get this shell's PYTHONPATH (else the repository's python/): what their Python lacks
# (crc32c, for checkpoints) travels there.
# Writes under OUT: discover.txt, nodes.json, job.json (the job at its end), logs.txt (every
# rank's output), result.txt (the checks: exit code of `motley job watch`, the resumed steps).
# Exit 0 only if the job succeeded after exactly one restart (generation 2) and its last step was taken.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="${1:-$repo/gpu-out/system}"
bin="${MOTLEY_BIN_DIR:-$repo/target/ci}"
steps="${SYSTEM_STEPS:-200}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$(mktemp -d /tmp/motley-gpu-system.XXXXXX)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null; done
  sleep 1
  for p in "${pids[@]}"; do kill -KILL -- "-$p" 2>/dev/null; done
  cp -r "$work/agent" "$out/agent-files" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
say() { echo "$*" | tee -a "$out/result.txt"; }
ldd "$bin/motley-agent" > "$out/ldd.txt" 2>&1
"$bin/motley-agent" discover > "$out/discover.txt" 2>&1
say "discover rc=$?"
export MOTLEY_COORDINATOR=http://127.0.0.1:7070
setsid "$bin/motley-coordinator" --listen 127.0.0.1:7070 --grpc-listen 127.0.0.1:7071 --insecure \
  --heartbeat-ms 500 --data-dir "$work/coordinator" > "$out/coordinator.txt" 2>&1 &
pids+=($!)
sleep 1
inventory=()
[ -n "${SYSTEM_INVENTORY:-}" ] && inventory=(--inventory "$SYSTEM_INVENTORY")
setsid "$bin/motley-agent" "${inventory[@]}" --coordinator http://127.0.0.1:7071 --node gpu0 --allow-root-ranks --rank-env PYTHONPATH \
  --work-dir "$work/agent" --shm-dir "$work/shm" --data-listen 127.0.0.1:0 --logs-listen 127.0.0.1:0 \
  > "$out/agent.txt" 2>&1 &
pids+=($!)
for _ in $(seq 60); do
  "$bin/motley" node list -o json > "$out/nodes.json" 2>/dev/null && grep -q '"live": *true' "$out/nodes.json" && break
  sleep 0.5
done
say "node live: $(grep -c '"live": *true' "$out/nodes.json" 2>/dev/null)"
gpus="$(nvidia-smi -L 2>/dev/null | wc -l)"
[ "$gpus" -ge 1 ] || gpus=1
model="${SYSTEM_MODEL:-"{name: gpu-check-llama, family: llama, layers: 8, hidden: 1024, heads: 16, kv_heads: 8, \
ffn_hidden: 2816, seq_len: 512, vocab: 32000, gated_mlp: true}"}"
cat > "$work/job.yaml" <<EOF
name: gpu-system
model: $model
global_batch: ${SYSTEM_BATCH:-32}
resources: {gpus: $gpus}
run: '${SYSTEM_PYTHON:-python3} -m motley_torch.train --steps $steps --seed 1 --lr 3e-4'
envs: {PYTHONPATH: '${PYTHONPATH:-$repo/python}'}
checkpoint: {every: 25, cloud: 'file://$work/cloud'}
max_restarts: 1
max_preemptions: 0
EOF
"$bin/motley" job submit "$work/job.yaml" -o json > "$out/submit.json" 2>&1
say "submit rc=$?"
# Kill the rank once it has printed 60 steps (between checkpoints: what follows step 50 or 75 is
# lost, the step before is kept).
killed=0
for _ in $(seq 1200); do
  n="$("$bin/motley" job logs 1 2>/dev/null | grep -c '"step"')"
  if [ "${n:-0}" -ge 60 ]; then
    pkill -KILL -f 'motley_torch.train' && killed=1
    break
  fi
  "$bin/motley" job show 1 -o json 2>/dev/null | grep -q '"state": *"\(failed\|succeeded\|cancelled\)"' && break
  sleep 0.5
done
say "killed the rank after 60 steps: $killed"
timeout 600 "$bin/motley" job watch 1 > "$out/watch.txt" 2>&1
rc=$?
say "job watch rc=$rc"
"$bin/motley" job show 1 -o json > "$out/job.json" 2>&1
"$bin/motley" job logs 1 > "$out/logs.txt" 2>&1
"$bin/motley" ckpt list 1 > "$out/ckpt.txt" 2>&1
last="$(grep -o '"step": *[0-9]*' "$out/logs.txt" | tail -1 | grep -o '[0-9]*$')"
generation="$(grep -o '"generation": *[0-9]*' "$out/job.json" | head -1 | grep -o '[0-9]*$')"
say "last step $last of $((steps - 1)); generation ${generation:-?} (2: one restart); mfu lines $(grep -c '"mfu"' "$out/logs.txt")"
[ "$rc" -eq 0 ] && [ "$killed" -eq 1 ] && [ "${last:-0}" -eq $((steps - 1)) ] && [ "${generation:-0}" -eq 2 ]
