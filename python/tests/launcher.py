"""Test helpers: run `motley plan`, hand-write plans in the documented form, and start one
local CPU process per rank of a plan with exactly the environment the Motley agent gives a
rank (agent/src/ranks/supervisor/launch.rs), MOTLEY_NCCL_GROUPS written as contract/src/groups.rs writes it."""

from __future__ import annotations

import atexit
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import rank_fork

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
REPO = HERE.parent.parent
PYTHON = sys.executable


def python_env(**extra: str) -> Dict[str, str]:
    """os.environ for a child Python that imports motley_torch from this tree even when the
    package is not installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(HERE.parent), env.get("PYTHONPATH")) if x)
    env.update(extra)
    return env


def motley_bin() -> Optional[str]:
    b = os.environ.get("MOTLEY_BIN") or str(REPO / "target" / "release" / "motley")
    return b if os.path.exists(b) and os.access(b, os.X_OK) else None


def motley_plan(cluster: str, model: str, global_batch: int, *extra: str) -> dict:
    """`motley plan -o json` on a cluster and model file of tests/data."""
    b = motley_bin()
    if b is None:
        raise RuntimeError("no motley binary: set MOTLEY_BIN or build target/release/motley")
    cmd = [b, "plan", "--cluster", str(DATA / cluster), "--model", str(DATA / model),
           "--global-batch", str(global_batch), *extra, "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr}")
    return json.loads(out.stdout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- what the coordinator and the agent compute, re-implemented from the Rust sources --------


def two_gloo_ranks(worker: str, timeout: float = 120.0) -> List[str]:
    """Run `worker` (Python source; argv: its rank, then a free port for a two-rank gloo group
    on localhost) as ranks 0 and 1 at once; each rank's stdout once both exited 0."""
    port = str(free_port())
    env = python_env(OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", worker, str(r), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [out for out, _ in outs]


def kill_group(p: subprocess.Popen):
    """SIGKILL `p` and its process group (it leads one: started with start_new_session), and
    reap it."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            p.kill()
        p.wait()


def ranks_of(plan: dict) -> List[dict]:
    """coordinator/src/planning/mod.rs `ranks_of` (and the local ranks the launch gives each node)."""
    out, local = [], {}
    for ri, r in enumerate(plan["replicas"]):
        for si, s in enumerate(r["stages"]):
            tp = max(1, int(s["tp"]))
            for pos, g in enumerate(s["gpus"]):
                lr = local.get(g["node"], 0)
                local[g["node"]] = lr + 1
                out.append(dict(rank=len(out), node=g["node"], gpu=g["index"], local_rank=lr, replica=ri, stage=si,
                                layer_start=s["layers"][0], layer_end=s["layers"][1], tp_rank=pos % tp, tp_size=tp,
                                stage_dp_rank=pos // tp, stage_dp_size=s["dp"], pp_size=len(r["stages"]),
                                replicas=len(plan["replicas"])))
    for r in out:
        r["local_world_size"] = local[r["node"]]
    return out


def groups_for_rank(plan: dict, node: str, gpu: int, extended: bool = True):
    """contract/src/groups.rs `for_rank`: the rank's groups (env with node_env on top) and the
    settings common to all of them. `extended` adds index, gpus and layers (the newer agent)."""
    groups = []
    for i, g in enumerate(plan.get("comm_groups") or []):
        if not any(m["node"] == node and m["index"] == gpu for m in g["gpus"]):
            continue
        env = {}
        for src in (g.get("env") or {}, (g.get("node_env") or {}).get(node) or {}):
            for k, v in src.items():
                env[k] = v if isinstance(v, str) else json.dumps(v)
        e = {"kind": g["kind"], "replica": g.get("replica"), "stage": g.get("stage"), "nccl_net": g.get("nccl_net"),
             "env": env}
        if extended:
            e.update(index=i, gpus=g["gpus"], layers=g.get("layers"))
        groups.append(e)
    common = {}
    if groups:
        first = groups[0]["env"]
        common = {k: v for k, v in first.items() if all(x["env"].get(k) == v for x in groups[1:])}
    return groups, common


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    log: str  # stdout + stderr as the agent's rank log has them (stderr here)
    groups_log: List[dict]
    env: Dict[str, str]


def launch(plan: dict, args: List[str], workdir: Path, timeout: float = 240.0, extended: bool = True,
           module: str = "motley_torch.train", extra_env: Optional[Dict[str, str]] = None,
           rank_env: Optional[Dict[int, Dict[str, str]]] = None, cuda: bool = False) -> List[RankResult]:
    """Start every rank of `plan` on localhost (gloo on the CPU), wait, collect outputs.
    `extra_env` goes to every rank, then `rank_env[RANK]` to that rank. `cuda`: each rank sees
    its plan GPU, as an agent's would (NCCL); otherwise none, also on a machine with GPUs (a
    plan's nodes "a" and "b" both name GPU 0, which one machine's ranks cannot share)."""
    return wait_ranks(start_ranks(plan, args, workdir, extended, module, extra_env, rank_env, cuda), workdir, timeout)


def start_ranks(plan: dict, args: List[str], workdir: Path, extended: bool = True, module: str = "motley_torch.train",
                extra_env: Optional[Dict[str, str]] = None, rank_env: Optional[Dict[int, Dict[str, str]]] = None,
                cuda: bool = False):
    """`launch`'s start: every rank's process, its own session, running; `wait_ranks` collects."""
    workdir.mkdir(parents=True, exist_ok=True)
    plan_path = workdir / "plan.json"
    plan_path.write_text(json.dumps(plan))
    ranks = ranks_of(plan)
    port = free_port()
    base = {k: v for k, v in python_env().items() if not k.startswith(("MOTLEY_", "NCCL_"))}
    base.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_DEVICE_ORDER="PCI_BUS_ID")
    procs = []
    for r in ranks:
        groups, common = groups_for_rank(plan, r["node"], r["gpu"], extended)
        gfile = workdir / f"rank{r['rank']}.groups.json"
        gfile.write_text(json.dumps(groups))
        env = dict(base)
        env.update({
            "RANK": str(r["rank"]), "WORLD_SIZE": str(len(ranks)), "LOCAL_RANK": str(r["local_rank"]),
            "LOCAL_WORLD_SIZE": str(r["local_world_size"]), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "CUDA_VISIBLE_DEVICES": str(r["gpu"]) if cuda else "", "MOTLEY_NODE": r["node"], "MOTLEY_JOB": "1",
            "MOTLEY_GENERATION": "0", "MOTLEY_REPLICA": str(r["replica"]), "MOTLEY_STAGE": str(r["stage"]),
            "MOTLEY_LAYER_START": str(r["layer_start"]), "MOTLEY_LAYER_END": str(r["layer_end"]),
            "MOTLEY_PLAN": str(plan_path), "MOTLEY_TP_RANK": str(r["tp_rank"]), "MOTLEY_TP_SIZE": str(r["tp_size"]),
            "MOTLEY_STAGE_DP_RANK": str(r["stage_dp_rank"]), "MOTLEY_STAGE_DP_SIZE": str(r["stage_dp_size"]),
            "MOTLEY_DP_RANK": str(r["replica"]), "MOTLEY_DP_SIZE": str(r["replicas"]),
            "MOTLEY_PP_RANK": str(r["stage"]), "MOTLEY_PP_SIZE": str(r["pp_size"]),
            "MOTLEY_NCCL_GROUPS": str(gfile),
            "MOTLEY_GROUP_LOG": str(workdir / f"rank{r['rank']}.group.log"),
        })
        for k, v in common.items():
            env.setdefault(k, v)
        env.update(extra_env or {})
        env.update((rank_env or {}).get(r["rank"], {}))
        out = open(workdir / f"rank{r['rank']}.out", "w")
        err = open(workdir / f"rank{r['rank']}.log", "w")
        server = rank_fork_server() if module in rank_fork.RUN and not cuda else None
        if server is not None and server.starts_like(env):
            p = server.spawn(module, args, env, workdir, out, err)
        else:
            p = subprocess.Popen([PYTHON, "-m", module, *args], env=env, stdout=out, stderr=err, cwd=workdir,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        procs.append((r, p, out, err, env))
    return procs


@functools.lru_cache(maxsize=None)
def rank_fork_server() -> Optional[rank_fork.RankForkServer]:
    """The session's rank server (rank_fork.py: ranks forked from a process that imported torch
    once), or None where MOTLEY_TEST_FORK=0 asks for `python -m` for every rank."""
    if os.environ.get("MOTLEY_TEST_FORK", "1") == "0":
        return None
    env = {k: v for k, v in python_env().items() if not k.startswith(("MOTLEY_", "NCCL_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES="")
    server = rank_fork.RankForkServer(PYTHON, env)
    atexit.register(server.close)
    return server


def wait_ranks(procs, workdir: Path, timeout: float) -> List[RankResult]:
    deadline = time.monotonic() + timeout
    timed_out = False
    for r, p, out, err, env in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    results = []
    for r, p, out, err, env in procs:
        kill_group(p)
        out.close()
        err.close()
        n = r["rank"]
        glog = workdir / f"rank{n}.group.log"
        lines = [json.loads(x) for x in glog.read_text().splitlines()] if glog.exists() else []
        results.append(RankResult(n, p.returncode, (workdir / f"rank{n}.out").read_text(),
                                  (workdir / f"rank{n}.log").read_text(), lines, env))
    if timed_out:
        logs = "\n".join(f"--- rank {x.rank} ({x.returncode})\n{x.log[-3000:]}" for x in results)
        raise AssertionError(f"ranks did not finish within {timeout} s\n{logs}")
    return results


def check_ok(results: List[RankResult]):
    bad = [x for x in results if x.returncode != 0]
    if bad:
        logs = "\n".join(f"--- rank {x.rank} exit {x.returncode}\n{x.log[-4000:]}" for x in bad)
        raise AssertionError(f"{len(bad)} rank(s) failed\n{logs}")


def losses(stdout: str) -> List[float]:
    docs = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return [d["loss"] for d in docs if "loss" in d]


def eval_losses(stdout: str) -> List[tuple]:
    docs = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return [(d["step"], d["eval_loss"]) for d in docs if "eval_loss" in d]


def single_process(model: str, global_batch: int, seq_len: int, steps: int, seed: int, save: Optional[Path] = None,
                   extra: Optional[List[str]] = None) -> List[float]:
    """The losses of a single-process run (`--single-process`) with these flags: a new process
    every call (reference_losses shares one run between tests)."""
    cmd = [PYTHON, "-m", "motley_torch.train", "--single-process", "--model", model, "--global-batch",
           str(global_batch), "--seq-len", str(seq_len), "--steps", str(steps), "--seed", str(seed), *(extra or [])]
    if save is not None:
        cmd += ["--save-params", str(save)]
    env = python_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    server = rank_fork_server()
    if server is None or not server.starts_like(env):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr
        return losses(out.stdout)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = server.spawn("motley_torch.train", cmd[3:], env, os.getcwd(), out, err)
        try:
            code = p.wait(timeout=300)
        finally:
            kill_group(p)
        out.seek(0)
        err.seek(0)
        assert code == 0, err.read()
        return losses(out.read())


@functools.lru_cache(maxsize=None)
def _reference(model: str, global_batch: int, seq_len: int, steps: int, seed: int) -> tuple:
    return tuple(single_process(model, global_batch, seq_len, steps, seed))


def reference_losses(model: str, global_batch: int, seq_len: int, steps: int, seed: int) -> List[float]:
    """single_process's losses, one run per set of flags for the whole session: the reference an
    end-to-end test's losses are held to (the run is deterministic; the suite's time is its
    processes, BENCHMARKS "Tests on both cores")."""
    return list(_reference(model, global_batch, seq_len, steps, seed))


# ---- plans written by hand in the documented form --------------------------------------------


def hand_plan(model_spec: dict, global_batch: int, micro_batch: int, replicas: List[dict],
              node_kind: Optional[Dict[str, str]] = None, with_model_spec: bool = True) -> dict:
    """A plan document with comm_groups made by the rules of solver/src/network.rs (tp groups,
    then pipeline hops, then gradient rings per layer segment and TP rank). `replicas`:
    [{micro_batches, stages: [{layers, tp, dp, gpus: [(node, index), ...]}]}]. `node_kind`
    gives each node's RDMA island ("ib" / "roce") for the transport fields; nodes on no island
    or rings mixing islands use sockets."""
    node_kind = node_kind or {}
    reps = []
    for r in replicas:
        stages = [dict(layers=list(s["layers"]), gpu=s.get("gpu", "cpu"), tp=s["tp"], dp=s["dp"],
                       gpus=[{"node": n, "index": i} for n, i in s["gpus"]]) for s in r["stages"]]
        reps.append(dict(samples=r["micro_batches"] * micro_batch, micro_batches=r["micro_batches"], stages=stages))

    def group(kind, gpus, replica, stage, layers):
        nodes = sorted({g["node"] for g in gpus})
        kinds = {node_kind.get(n) for n in nodes}
        if len(nodes) == 1:
            transport, env, net = "nvlink", {}, None
        elif len(kinds) == 1 and None not in kinds:
            k = kinds.pop()
            transport, net = k, "IB"
            env = {"NCCL_NET": "IB", "NCCL_IB_DISABLE": "0", "NCCL_IB_HCA": "=mlx5_0:1", "NCCL_CROSS_NIC": "0"}
            if k == "roce":
                env["NCCL_IB_GID_INDEX"] = "3"
        else:
            transport, net, env = "socket", "Socket", {"NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "=eth0"}
        return dict(kind=kind, gpus=gpus, transport=transport, nics=[], env=env, nccl_net=net, replica=replica,
                    stage=stage, layers=list(layers))

    groups = []
    for ri, r in enumerate(reps):
        for si, s in enumerate(r["stages"]):
            if s["tp"] >= 2:
                for d in range(s["dp"]):
                    groups.append(group("tp", s["gpus"][d * s["tp"] : (d + 1) * s["tp"]], ri, si, s["layers"]))
    for ri, r in enumerate(reps):
        for si in range(len(r["stages"]) - 1):
            b = r["stages"][si]["layers"][1]
            groups.append(group("pp", r["stages"][si]["gpus"] + r["stages"][si + 1]["gpus"], ri, si, [b, b]))
    layers = model_spec["layers"]
    cuts = sorted({0, layers} | {s["layers"][0] for r in reps for s in r["stages"]})
    tp = reps[0]["stages"][0]["tp"]
    for l0, l1 in zip(cuts[:-1], cuts[1:]):
        for j in range(tp):
            gpus = []
            for r in reps:
                s = next(s for s in r["stages"] if s["layers"][0] <= l0 < s["layers"][1])
                gpus += [s["gpus"][d * s["tp"] + j] for d in range(s["dp"])]
            if len(gpus) >= 2:
                groups.append(group("dp", gpus, None, None, [l0, l1]))
    doc = dict(model=model_spec["name"], global_batch=global_batch, micro_batch=micro_batch,
               seq_len=model_spec["seq_len"], replicas=reps, comm_groups=groups)
    if with_model_spec:
        doc["model_spec"] = model_spec
    return doc
