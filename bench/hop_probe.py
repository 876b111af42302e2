#!/usr/bin/env python3
"""One pipeline hop across the lab's shaped link, alone (BENCHMARKS.md, "Profiles beside each
run, and the keep-going vote apart"): two gloo ranks on emulated nodes (bench/mixed/lab.yaml's
islands and 100 Mbit/s link, each end in its node's CPU share as `mixed_cluster.LinkShares`
makes it) send the lab model's activations of one micro-batch (2 x 128 x 256 fp32, 262 KB),
twelve times; prints per case the receiver's milliseconds from the send's post to its wait's
return (median of the last ten).

Cases: `idle` (both ends wait), `sendbusy` (the sender computes 300 ms after posting),
`recvbusy` (the receiver posts its receive, computes 60 ms, then waits: the pipeline's receives
posted ahead over gloo), `recvbusy-late` (the receiver computes 60 ms, then posts and waits: the
pipeline before it posted ahead; gloo moves nothing until the receive is posted), and
`recvbusy-mainonly` (as `recvbusy` with only the receiver's main thread in its share, via cgroup
v1's `tasks`, gloo's threads outside).

    sudo .venv/bin/python bench/hop_probe.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from project_venv import use_project_venv

REPO = Path(__file__).resolve().parent.parent
use_project_venv("hop_probe")
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "python" / "tests"))
sys.path.insert(0, str(REPO / "python"))

import mixed_cluster as mc  # noqa: E402
from netns import Net  # noqa: E402

SIDE = """
import datetime, json, statistics, sys, threading, time
import torch, torch.distributed as dist
rank, host, port, procs, nbytes, case = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6]
torch.set_num_threads(1)
store = dist.TCPStore(host, port, 2, rank == 0, datetime.timedelta(seconds=60), wait_for_workers=False)
if rank == 0:
    print("ready", store.port, flush=True)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
if case.endswith("mainonly") and rank == 1:
    open(procs.replace("cgroup.procs", "tasks"), "w").write(str(threading.get_native_id()))
else:
    open(procs, "w").write("0")
x, a = torch.ones(nbytes // 4), torch.randn(256, 256)
def compute(seconds):
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(a, a)
res = []
for _ in range(12):
    dist.barrier()
    if rank == 0:
        dist.send(torch.tensor([time.perf_counter()], dtype=torch.float64), 1, tag=1)
        w = dist.isend(x, 1, tag=2)
        if case == "sendbusy":
            compute(0.3)
        w.wait()
    else:
        t = torch.zeros(1, dtype=torch.float64)
        late = case == "recvbusy-late"
        w = None if late else dist.irecv(x, 0, tag=2)
        dist.recv(t, 0, tag=1)
        if case.startswith("recvbusy"):
            compute(0.06)
        if late:
            w = dist.irecv(x, 0, tag=2)
        w.wait()
        res.append((time.perf_counter() - t.item()) * 1e3)
if rank == 1:
    print(json.dumps({"case": case, "bytes": nbytes, "ms": [round(r, 1) for r in res],
                      "median_ms": round(statistics.median(res[2:]), 1)}), flush=True)
dist.destroy_process_group()
"""


def main() -> int:
    why = mc.requirements()
    if why:
        raise SystemExit(f"hop_probe: {why}")
    c = mc.read_cluster(REPO / "bench" / "mixed" / "lab.yaml")
    net = Net(c["islands"], link_mbit=c["across_mbit"])
    shares = mc.LinkShares({n: float(e["emulate"]["cpu"]) for n, e in c["entries"].items()})
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
    hop = 2 * 128 * 256 * 4
    try:
        # The A100 node sends to a V100 node across the link, as Whale's lab plan's last hop.
        a, b = "n1", "n2"
        for case in ("idle", "sendbusy", "recvbusy", "recvbusy-late", "recvbusy-mainonly"):
            argv = lambda rank, port, node: net.argv(node, [sys.executable, "-c", SIDE, str(rank), net.ip[a], str(port),
                                                            shares.procs(node), str(hop), case], cgroups=True)
            first = subprocess.Popen(argv(0, 0, a), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            ready = first.stdout.readline().split()
            if ready[:1] != ["ready"]:
                raise SystemExit(f"hop_probe: {first.stderr.read()[-2000:]}")
            second = subprocess.run(argv(1, int(ready[1]), b), capture_output=True, text=True, env=env, timeout=300)
            first.communicate(timeout=60)
            if second.returncode != 0:
                raise SystemExit(f"hop_probe: {case}: {second.stderr[-2000:]}")
            print(second.stdout.strip(), flush=True)
    finally:
        shares.close()
        net.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
