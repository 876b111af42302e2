"""A real coordinator and one real motley-agent per node, each agent (and so its ranks) inside its
node's network namespace (netns.Net): the network-change tests and bench/network_change.py run
jobs on it. The coordinator runs in the root namespace: REST on loopback (the test and the CLI
talk to it there), gRPC on the islands' gateway address (the agents reach it over the bridges).

The nodes' GPUs are declared (`gpu_types` passed with --gpu-types): ranks train on the CPU with
gloo over the node's `eth0`, so a declared type as slow as a CPU core makes the planner's
prices look like what the ranks do."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional

import yaml

from launcher import REPO, free_port, kill_group, motley_bin
from netns import Net


def bins() -> dict:
    b = motley_bin()
    assert b is not None, "no motley binary: set MOTLEY_BIN (python/run-tests does) or build target/ci/motley"
    out = {"motley": b}
    for sib in ("motley-coordinator", "motley-agent"):
        p = Path(b).with_name(sib)
        assert os.access(p, os.X_OK), f"{sib} is not next to {b}: cargo build --profile ci -p motley-agent -p motley --bins"
        out[sib] = str(p)
    return out


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOTLEY_", "NCCL_", "GLOO_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RUST_LOG="info")
    env.update(extra)
    return env


def port_on(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


class NetCluster:
    """`net`'s nodes each run an agent in its namespace declaring `entries[node]` (a cluster-file
    node entry; one with `emulate` gets the CPU controller mounted in its namespace, so it can
    hold its ranks to their shares). `gpu_types`: the coordinator's --gpu-types list. `agent_args`: more agent flags.
    `start`: the nodes whose agents start now (default every node; `start_agent` adds one)."""

    def __init__(self, tmp: Path, net: Net, entries: Dict[str, dict], gpu_types: Optional[List[dict]] = None,
                 heartbeat_ms: int = 250, agent_args: Optional[List[str]] = None,
                 coordinator_args: Optional[List[str]] = None, start: Optional[List[str]] = None):
        self.tmp, self.net, self.b = tmp, net, bins()
        self.procs: List[subprocess.Popen] = []
        self.agents: Dict[str, subprocess.Popen] = {}
        self.heartbeat_ms = heartbeat_ms
        self.agent_args = list(agent_args or [])
        self.coordinator_args = list(coordinator_args or [])
        self.gpu_types, self.entries = gpu_types, entries
        try:
            self.start_coordinator()
            for node in (net.nodes if start is None else start):
                self.start_agent(node)
        except BaseException:
            self.close()
            raise

    def start_coordinator(self):
        log = open(self.tmp / "coordinator.log", "a")
        argv = [self.b["motley-coordinator"], "--data-dir", str(self.tmp / "coordinator"), "--insecure",
                "--listen", f"127.0.0.1:{free_port()}",
                "--grpc-listen", f"{self.net.gateway}:{port_on(self.net.gateway)}",
                "--heartbeat-ms", str(self.heartbeat_ms), *self.coordinator_args]
        if self.gpu_types:
            types = self.tmp / "gpu-types.yaml"
            types.write_text(yaml.safe_dump({"gpu_types": self.gpu_types}))
            argv += ["--gpu-types", str(types)]
        self.coord = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, env=clean_env(),
                                      start_new_session=True)
        self.procs.append(self.coord)
        if hasattr(self.net, "own"):
            self.net.own(self.coord.pid)
        # "motley-coordinator listening on URL", then "motley-coordinator agents on URL".
        first = self.coord.stdout.readline().strip()
        second = self.coord.stdout.readline().strip()
        if not first or not second:
            self.coord.wait(timeout=10)
            raise AssertionError(f"the coordinator did not start\n{self.logs()}")
        self.rest = first.rsplit(" ", 1)[-1]
        self.grpc = second.rsplit(" ", 1)[-1]

    def start_agent(self, node: str):
        inv = self.tmp / f"{node}.yaml"
        inv.write_text(yaml.safe_dump(self.entries[node]))
        log = open(self.tmp / f"agent-{node}.log", "w")
        ip = self.net.ip[node]
        argv = self.net.argv(node, [
            self.b["motley-agent"], "--coordinator", self.grpc, "--node", node, "--inventory", str(inv),
            "--work-dir", str(self.tmp / "agents" / node), "--shm-dir", str(self.tmp / "shm" / node),
            "--allow-root-ranks", "--address", ip, "--logs-listen", f"{ip}:0", "--data-listen", f"{ip}:0",
            *self.agent_args], cgroups="emulate" in self.entries[node])
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=clean_env(), start_new_session=True)
        self.procs.append(p)
        self.agents[node] = p

    # ---- the REST API and the CLI --------------------------------------------------------------

    def get(self, path: str):
        for attempt in range(50):
            try:
                with urllib.request.urlopen(self.rest + path, timeout=10) as r:
                    return json.loads(r.read())
            except urllib.error.URLError:
                if attempt == 49:
                    raise
                time.sleep(0.2)

    def submit(self, spec: dict) -> int:
        req = urllib.request.Request(self.rest + "/api/v1/jobs", data=yaml.safe_dump(spec).encode(), method="POST",
                                     headers={"Content-Type": "application/yaml"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read())["id"]
        except urllib.error.HTTPError as e:
            raise AssertionError(f"submit refused ({e.code}): {e.read().decode(errors='replace')}") from None

    def job(self, jid: int) -> dict:
        return self.get(f"/api/v1/jobs/{jid}")

    def events(self, jid: int) -> list:
        return self.get(f"/api/v1/jobs/{jid}/events")

    def plan(self, jid: int) -> dict:
        return self.get(f"/api/v1/jobs/{jid}/plan")["plan"]

    def cli(self, *args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        """`motley ARGS --coordinator REST`."""
        out = subprocess.run([self.b["motley"], *args, "--coordinator", self.rest], capture_output=True, text=True,
                             env=clean_env(), timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"motley {' '.join(args)} failed ({out.returncode}): {out.stderr}")
        return out

    def net_show(self) -> dict:
        """`motley net show -o json`."""
        return json.loads(self.cli("net", "show", "-o", "json").stdout)

    def wait(self, what, timeout: float, every: float = 0.25, why: str = ""):
        end = time.time() + timeout
        while time.time() < end:
            v = what()
            if v:
                return v
            time.sleep(every)
        raise AssertionError(f"timed out after {timeout} s{': ' + why if why else ''}\n{self.logs()}")

    def wait_live(self, timeout: float = 30):
        self.wait(lambda: sum(n["live"] for n in self.get("/api/v1/nodes")) == len(self.agents), timeout,
                  why="every agent registers")

    def wait_done(self, jid: int, timeout: float) -> dict:
        self.wait(lambda: self.job(jid)["state"] in ("succeeded", "failed", "cancelled"), timeout, every=0.5,
                  why=f"job {jid} ends")
        return self.job(jid)

    def logs(self) -> str:
        out = []
        for f in sorted(self.tmp.glob("*.log")):
            out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)

    def lose_node(self, node: str):
        """`node` vanishes: its agent and everything running in its namespace (its ranks) are
        SIGKILLed."""
        kill_group(self.agents[node])
        self._kill_namespace(node)

    def _kill_namespace(self, node: str):
        # Ranks run in their own sessions: whatever still runs in a node's namespace goes too.
        pids = subprocess.run(["ip", "netns", "pids", self.net.ns[node]], capture_output=True, text=True).stdout
        for pid in pids.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (OSError, ValueError):
                pass

    def close(self):
        for p in self.procs:
            kill_group(p)
        for node in self.net.nodes:
            self._kill_namespace(node)


# ---- jobs ----------------------------------------------------------------------------------------


def train_job(name: str, model: dict, global_batch: int, train_steps: int, seed: int, every: int, cloud: Path,
              **extra) -> dict:
    """The reference trainer on every rank for `train_steps` steps, checkpointing every `every`
    steps; gloo over eth0. `extra`: more job-file fields (`steps`, `replan`, ...)."""
    job = {
        "name": name,
        "model": model,
        "global_batch": global_batch,
        "run": f"{shlex.quote(sys.executable)} -m motley_torch.train --steps {train_steps} --seed {seed}",
        "envs": {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "python"), "GLOO_SOCKET_IFNAME": "eth0"},
        "checkpoint": {"every": every, "keep": 2, "cloud": f"file://{cloud}"},
    }
    job.update(extra)
    return job


def plan_nodes(plan: dict) -> set:
    return {g["node"] for r in plan["replicas"] for s in r["stages"] for g in s["gpus"]}


def rank0_lines(work: Path, job: int, generation: int) -> list:
    """The JSON lines global rank 0 of a launch printed (from its log on its node)."""
    for log in work.glob(f"agents/*/jobs/{job}/{generation}/rank-0.log"):
        out = []
        for line in log.read_text().splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out
    return []


def rank0_losses(work: Path, job: int, generation: int) -> list:
    return [(d["step"], d["loss"]) for d in rank0_lines(work, job, generation) if "loss" in d]


# ---- the setting the network-change tests and the benchmark share --------------------------------
#
# Two islands of two nodes, one declared GPU each. The GPU types are declared as slow as a CPU
# rank (0.01 TFLOPS), one type per island: the planner groups nodes into classes, and nodes of
# one class are priced at the slowest link among them, so the islands must be two classes for
# the planner to see a fast inside and a slow link between. Every link (each node's and the
# inter-island one) is shaped to RATE_MBIT and declared so (`entries`); the drop takes the
# inter-island link to DROP_MBIT. The planner then makes a 4-stage pipeline across both islands at RATE_MBIT, and
# a 2-stage pipeline on island A after the drop (`motley replan` says switch); the ranks agree:
# the old plan's hop across the islands becomes the bottleneck (test_network_change.py checks
# both).

ISLANDS = {"A": ["n0", "n1"], "B": ["n2", "n3"]}
RATE_MBIT = 50.0
DROP_MBIT = 5.0
GPU_TFLOPS = 0.01
GLOBAL_BATCH = 16
MODEL_FILE = Path(__file__).resolve().parent / "data" / "net-tiny.yaml"


def gpu_types() -> List[dict]:
    return [{"name": f"CPU-{i}", "memory_gib": 4, "tflops": GPU_TFLOPS, "mem_bw_gbps": 20} for i in ISLANDS]


# The planner prices Ethernet at 85% of the NIC's line rate (solver/src/hardware.rs,
# nic_efficiency): a NIC declared at RATE / 0.85 is priced at RATE, what the probes measure of
# a link shaped to RATE, so a link as shaped is a link as declared (`net show`'s
# declared_gb_per_s) and only the drop is a change.
ETHERNET_EFFICIENCY = 0.85


def entries(mbit: float = RATE_MBIT) -> Dict[str, dict]:
    """Each node's inventory: its island's GPU type, one GPU, eth0 declared so that the planner
    prices it at `mbit`."""
    gbps = round(mbit / ETHERNET_EFFICIENCY / 1000, 6)
    return {n: {"gpu": f"CPU-{i}", "gpus": 1, "nics": [{"name": "eth0", "kind": "ethernet", "gbps": gbps}]}
            for i, nodes in ISLANDS.items() for n in nodes}


def cluster_file(mbit: float = RATE_MBIT, nodes: Optional[List[str]] = None) -> dict:
    """The same nodes as a cluster file for `motley plan`."""
    e = entries(mbit)
    return {"name": "islands", "gpu_types": gpu_types(),
            "nodes": [dict(name=n, **e[n]) for n in (nodes or list(e))]}


def bandwidth_file(inside_mbit: float, across_mbit: float) -> dict:
    """Measured pairs (`--bandwidth`): each island's pair at `inside_mbit`, every pair across at
    `across_mbit` (GB/s = Mbit/s / 8000)."""
    pairs = []
    nodes = [n for v in ISLANDS.values() for n in v]
    for i, a in enumerate(nodes):
        for b in nodes[i + 1:]:
            same = any(a in v and b in v for v in ISLANDS.values())
            pairs.append({"a": a, "b": b, "gb_per_s": (inside_mbit if same else across_mbit) / 8000})
    return {"pairs": pairs}


def model() -> dict:
    return yaml.safe_load(MODEL_FILE.read_text())
