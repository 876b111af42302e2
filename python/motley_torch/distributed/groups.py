"""`motley_torch.init()`: a rank started by the Motley agent joins its job.

It reads the plan (MOTLEY_PLAN), its groups (MOTLEY_NCCL_GROUPS) and the torchrun variables,
joins the default process group (NCCL on CUDA, gloo on the CPU) and creates EVERY
communication group of the plan in the plan's `comm_groups` order (creating a group is
collective: every rank takes part in every creation). Just before creating one of its own
groups a rank applies that group's NCCL `env` (node_env merged, as the agent wrote it) on top
of the process environment it started with, and on CUDA passes the group's `nccl_net` as
`ncclConfig_t.netName` through `ProcessGroupNCCL.Options().config`; it then forces the
communicator into existence (an all-reduce of one element among the members) while those
settings are in force, and puts the environment back. `NCCL_IB_DISABLE` is never set: NCCL
caches it per process, so it would switch RDMA off for the rank's later groups.

Each rank logs one JSON line per group of its own, in creation order (kind, members as global
ranks, the env applied, the net name), to stderr and, when MOTLEY_GROUP_LOG names a file, to
that file.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..plan import CommGroup, Plan, RankPlace, Stage
from ..spec import PlanError

# ncclConfig_t fields a group's NCCL settings carry per communicator (the env variable NCCL
# reads for the same thing once per process); net_name comes from the group's `nccl_net`.
CONFIG_FROM_ENV = {
    "NCCL_IB_TC": "traffic_class",
    "NCCL_CGA_CLUSTER_SIZE": "cga_cluster_size",
    "NCCL_MIN_CTAS": "min_ctas",
    "NCCL_MAX_CTAS": "max_ctas",
    "NCCL_COLLNET_ENABLE": "collnet_enable",
}


def _refused(key: str, value: str) -> bool:
    """NCCL_IB_DISABLE=1 (anything but 0) is never set by us: NCCL caches it per process."""
    return key == "NCCL_IB_DISABLE" and value.strip() != "0"


class RankEnvError(PlanError):
    pass


def _env(name: str, required: bool = True) -> Optional[str]:
    v = os.environ.get(name)
    if v is None or v == "":
        if required:
            raise RankEnvError(f"{name}: not set; motley_torch.init() runs in a rank started by the Motley agent "
                               f"(or a launcher setting the same variables)")
        return None
    return v


def _env_int(name: str, required: bool = True) -> Optional[int]:
    v = _env(name, required)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise RankEnvError(f"{name}: expected an integer, got {v!r}")


@dataclass
class Group:
    """A created communication group of the plan."""

    index: int
    kind: str
    ranks: List[int]
    layers: Tuple[int, int]
    replica: Optional[int]
    stage: Optional[int]
    pg: object = None  # the ProcessGroup on members, None elsewhere
    env: Dict[str, str] = field(default_factory=dict)
    net_name: Optional[str] = None


@dataclass
class Segment:
    """Layers [l0, l1) whose gradients one ring (the rank's TP rank of every TP group holding
    them, in every replica) sums; group None when the rank alone holds them."""

    layers: Tuple[int, int]
    ranks: List[int]
    group: Optional[Group]


@dataclass
class RankView:
    plan: Plan
    rank: int
    world_size: int
    local_rank: int
    node: str
    gpu: int
    replica: int
    stage: int
    layers: Tuple[int, int]
    tp_rank: int
    tp_size: int
    stage_dp_rank: int
    stage_dp_size: int
    pp_rank: int
    pp_size: int
    device: torch.device
    backend: str
    tp_ranks: List[int]
    tp_group: Optional[Group]
    # Ranks of the neighbouring stages of this replica (all of them), and the hop groups.
    pp_prev_ranks: List[int]
    pp_next_ranks: List[int]
    pp_prev_group: Optional[Group]
    pp_next_group: Optional[Group]
    segments: List[Segment]
    groups: List[Group]  # every group of the plan, in creation order (pg None where not a member)
    # Under a membership after a lost replica (`keep_going`): the members' world group (None:
    # the default group, every rank), the tied matrix's group among them, the epoch and the
    # lowest member rank, which prints the progress lines.
    world_group: object = None
    tied_group: object = None
    epoch: int = 0
    leader: int = 0
    # How a cross-replica collective's work is waited for (None: `work.wait()`); under
    # keep-going, in slices that give up when a newer membership is out (`keep_going`).
    wait_work: object = None

    def wait(self, work):
        """Wait for `work`, a collective over groups that span replicas."""
        return work.wait() if self.wait_work is None else self.wait_work(work)

    @property
    def stage_info(self) -> Stage:
        return self.plan.replicas[self.replica].stages[self.stage]

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp_size - 1

    def my_groups(self) -> List[Group]:
        return [g for g in self.groups if self.rank in g.ranks]

    def summary(self) -> dict:
        """The view as plain data (what the trainer logs as `motley-view {...}`)."""
        return {
            "rank": self.rank, "node": self.node, "gpu": self.gpu, "replica": self.replica, "stage": self.stage,
            "layers": list(self.layers), "tp_rank": self.tp_rank, "tp_ranks": list(self.tp_ranks),
            "stage_dp_rank": self.stage_dp_rank, "stage_dp_size": self.stage_dp_size,
            "pp_prev_ranks": list(self.pp_prev_ranks), "pp_next_ranks": list(self.pp_next_ranks),
            "segments": [{"layers": list(s.layers), "ranks": list(s.ranks),
                          "group": s.group.index if s.group is not None else None} for s in self.segments],
            "backend": self.backend, "device": str(self.device),
        }


def _log_line(line: dict):
    text = json.dumps(line, sort_keys=True)
    print(f"motley-group {text}", file=sys.stderr, flush=True)
    path = os.environ.get("MOTLEY_GROUP_LOG")
    if path:
        with open(path, "a") as f:
            f.write(text + "\n")


def nccl_options(net_name: Optional[str], env: Dict[str, str], comm_name: str,
                 timeout: Optional[datetime.timedelta] = None):
    """ProcessGroupNCCL options whose ncclConfig_t carries the group's netName (and the
    per-communicator fields of CONFIG_FROM_ENV its env sets). Returns (options, config fields
    set, warning or None)."""
    try:
        from torch.distributed import ProcessGroupNCCL
    except ImportError:  # pragma: no cover - torch built without NCCL
        return None, {}, "torch has no ProcessGroupNCCL; NCCL settings from env only"
    opts = ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    if timeout is not None and hasattr(opts, "_timeout"):
        opts._timeout = timeout  # new_group's timeout overrides it anyway; equal, torch does not warn
    cfg = getattr(opts, "config", None)
    if cfg is None:
        return opts, {}, f"torch {torch.__version__} exposes no ncclConfig_t; NCCL settings from env only"
    fields: Dict[str, object] = {}
    missing = []
    wanted: Dict[str, object] = {}
    if net_name is not None:
        wanted["net_name"] = net_name
    for key, attr in CONFIG_FROM_ENV.items():
        if key in env:
            try:
                wanted[attr] = int(env[key])
            except ValueError:
                pass
    wanted["comm_name"] = comm_name
    for attr, value in wanted.items():
        if hasattr(cfg, attr):
            setattr(cfg, attr, value)
            fields[attr] = value
        elif attr != "comm_name":
            missing.append(attr)
    warn = f"torch {torch.__version__} cannot pass ncclConfig_t.{', '.join(missing)}; env only" if missing else None
    return opts, fields, warn


def _entries(plan: Plan, node: str, gpu: int, path: str) -> Dict[int, dict]:
    """MOTLEY_NCCL_GROUPS entries by plan group index; checked against the plan."""
    try:
        with open(path) as f:
            entries = json.load(f)
    except OSError as e:
        raise RankEnvError(f"MOTLEY_NCCL_GROUPS: cannot read {path}: {e.strerror}")
    except json.JSONDecodeError as e:
        raise RankEnvError(f"MOTLEY_NCCL_GROUPS: {path} is not JSON ({e})")
    if not isinstance(entries, list):
        raise RankEnvError(f"MOTLEY_NCCL_GROUPS: {path} is not a JSON array")
    mine = plan.groups_of_gpu(node, gpu)
    if len(entries) != len(mine):
        raise RankEnvError(f"MOTLEY_NCCL_GROUPS: {path} lists {len(entries)} groups; the plan has {len(mine)} "
                           f"holding GPU {node}:{gpu}")
    out = {}
    for i, (e, g) in enumerate(zip(entries, mine)):
        if not isinstance(e, dict):
            raise RankEnvError(f"MOTLEY_NCCL_GROUPS: entry {i} is not an object")
        idx = e.get("index", g.index)
        if idx != g.index or e.get("kind") != g.kind:
            raise RankEnvError(f"MOTLEY_NCCL_GROUPS: entry {i} ({e.get('kind')}, index {idx}) is not the plan's "
                               f"comm_groups[{g.index}] ({g.kind}) for GPU {node}:{gpu}")
        if "gpus" in e and e["gpus"] is not None:
            gpus = [(str(m.get("node")), m.get("index")) for m in e["gpus"]] if isinstance(e["gpus"], list) else None
            if gpus != g.gpus:
                raise RankEnvError(f"MOTLEY_NCCL_GROUPS: entry {i}.gpus are not the plan's comm_groups[{g.index}].gpus")
        env = e.get("env") or {}
        if not isinstance(env, dict):
            raise RankEnvError(f"MOTLEY_NCCL_GROUPS: entry {i}.env is not an object")
        out[g.index] = {"env": {str(k): str(v) for k, v in env.items()}, "nccl_net": e.get("nccl_net", g.nccl_net)}
    return out


def _check_env_against_plan(plan: Plan, place: RankPlace):
    st = plan.stage_of(place.rank)
    checks = [
        ("WORLD_SIZE", plan.world_size),
        ("MOTLEY_REPLICA", place.replica),
        ("MOTLEY_STAGE", place.stage),
        ("MOTLEY_LAYER_START", place.layers[0]),
        ("MOTLEY_LAYER_END", place.layers[1]),
        ("MOTLEY_TP_RANK", place.tp_rank),
        ("MOTLEY_TP_SIZE", place.tp_size),
        ("MOTLEY_STAGE_DP_RANK", place.stage_dp_rank),
        ("MOTLEY_STAGE_DP_SIZE", st.dp),
        ("MOTLEY_DP_RANK", place.replica),
        ("MOTLEY_DP_SIZE", len(plan.replicas)),
        ("MOTLEY_PP_RANK", place.stage),
        ("MOTLEY_PP_SIZE", len(plan.replicas[place.replica].stages)),
    ]
    for name, want in checks:
        got = _env_int(name, required=False)
        if got is not None and got != want:
            raise RankEnvError(f"{name}: {got}, but the plan ({plan.source}) puts rank {place.rank} "
                               f"({place.node}:{place.gpu}) at {want}")


def init(plan_path: Optional[str] = None, model=None, timeout_s: float = 600.0) -> RankView:
    """Join the job: default process group plus every communication group of the plan."""
    plan_path = plan_path or _env("MOTLEY_PLAN")
    try:
        plan = Plan.load(plan_path, model)
    except PlanError as e:
        raise RankEnvError(f"MOTLEY_PLAN: {e}")
    rank = _env_int("RANK")
    world = _env_int("WORLD_SIZE")
    if world != plan.world_size:
        raise RankEnvError(f"WORLD_SIZE: {world}, but the plan ({plan_path}) has {plan.world_size} GPUs")
    if not 0 <= rank < world:
        raise RankEnvError(f"RANK: {rank} is outside [0, WORLD_SIZE={world})")
    place = plan.ranks[rank]
    node = os.environ.get("MOTLEY_NODE")
    if node is not None and node != place.node:
        raise RankEnvError(f"MOTLEY_NODE: {node!r}, but the plan puts rank {rank} on node {place.node!r}")
    _env("MASTER_ADDR")
    _env_int("MASTER_PORT")
    _check_env_against_plan(plan, place)
    groups_path = _env("MOTLEY_NCCL_GROUPS")
    entries = _entries(plan, place.node, place.gpu, groups_path)

    cuda = torch.cuda.is_available()
    if cuda:
        # CUDA_VISIBLE_DEVICES holds the rank's one GPU.
        device = torch.device("cuda", 0 if torch.cuda.device_count() == 1 else place.gpu)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        # No device_id: eager NCCL init would let torch make the groups by ncclCommSplit from the
        # world communicator; lazily, each group's communicator is its own ncclCommInitRankConfig
        # at the forcing all-reduce below, under the group's settings.
        dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout)

    base_env = dict(os.environ)
    groups: List[Group] = []
    for g in plan.comm_groups:
        member = rank in g.ranks
        grp = Group(g.index, g.kind, list(g.ranks), g.layers, g.replica, g.stage)
        opts = None
        warn = None
        config: Dict[str, object] = {}
        if member:
            e = entries[g.index]
            grp.env = {k: v for k, v in e["env"].items() if not _refused(k, v)}
            skipped = sorted(f"{k}={v}" for k, v in e["env"].items() if _refused(k, v))
            if skipped:
                warn = f"not set: {', '.join(skipped)} (NCCL caches it for the process)"
            grp.net_name = e["nccl_net"]
            _restore_env(base_env)
            os.environ.update(grp.env)
            if backend == "nccl":
                opts, config, w = nccl_options(grp.net_name, grp.env, f"motley-{g.kind}-{g.index}", timeout)
                warn = warn or w
        kw = {"pg_options": opts} if opts is not None else {}
        pg = dist.new_group(ranks=list(g.ranks), backend=backend, timeout=timeout, **kw)
        if member:
            # Make the communicator now, while this group's settings are in force.
            one = torch.ones(1, device=device)
            dist.all_reduce(one, group=pg)
            if int(one.item()) != len(g.ranks):
                raise RuntimeError(f"comm_groups[{g.index}]: all-reduce over {len(g.ranks)} members gave {one.item()}")
            if g.kind == "pp" and g.replica is not None and g.stage is not None:
                _warm_p2p(plan, g, pg, rank, device)
            grp.pg = pg
            _restore_env(base_env)
            line = {"rank": rank, "index": g.index, "kind": g.kind, "members": list(g.ranks), "env": grp.env,
                    "net_name": grp.net_name, "replica": g.replica, "stage": g.stage, "layers": list(g.layers),
                    "backend": backend, "nccl_config": config}
            if warn:
                line["warning"] = warn
            _log_line(line)
        groups.append(grp)
    _restore_env(base_env)
    return _view(plan, place, rank, world, device, backend, groups)


def hop_peers(plan: Plan, replica: int, stage: int) -> List[Tuple[int, int]]:
    """(sender, receiver) global ranks that exchange activations over hop stage -> stage+1 of
    `replica`: TP rank j of every overlapping pair of dp-slices (Plan.hop_pairs)."""
    rep = plan.replicas[replica]
    s, t = rep.stages[stage], rep.stages[stage + 1]
    return [(s.ranks[d * s.tp + j], t.ranks[e * t.tp + j]) for d, e, _ in plan.hop_pairs(replica, stage)
            for j in range(min(s.tp, t.tp))]


def _warm_p2p(plan: Plan, g: CommGroup, pg, rank: int, device):
    """NCCL makes a separate communicator per pair for send/recv unless the group's own exists:
    exchange one element over every pair of the hop now, while the group's settings hold. Pairs
    go in one order on every rank, so the blocking exchanges cannot deadlock."""
    for src, dst in hop_peers(plan, g.replica, g.stage):
        if rank == src:
            dist.send(torch.zeros(1, device=device), dst=dst, group=pg)
        elif rank == dst:
            dist.recv(torch.zeros(1, device=device), src=src, group=pg)


def _restore_env(base: Dict[str, str]):
    for k in list(os.environ):
        if k not in base:
            del os.environ[k]
    for k, v in base.items():
        if os.environ.get(k) != v:
            os.environ[k] = v


def _view(plan: Plan, place: RankPlace, rank: int, world: int, device, backend: str, groups: List[Group]) -> RankView:
    rep = plan.replicas[place.replica]
    st = rep.stages[place.stage]
    tp_ranks = st.tp_group_ranks(place.stage_dp_rank)
    tp_group = None
    if len(tp_ranks) > 1:
        tp_group = _find(groups, "tp", tp_ranks, f"the TP group {tp_ranks} of replica {place.replica} stage {place.stage}")
    prev_ranks = rep.stages[place.stage - 1].ranks if place.stage > 0 else []
    next_ranks = rep.stages[place.stage + 1].ranks if place.stage + 1 < len(rep.stages) else []
    pp_prev = _find(groups, "pp", prev_ranks + st.ranks, f"the pipeline hop into replica {place.replica} stage {place.stage}") if prev_ranks else None
    pp_next = _find(groups, "pp", st.ranks + next_ranks, f"the pipeline hop out of replica {place.replica} stage {place.stage}") if next_ranks else None
    segments = []
    for seg in plan.segments():
        if not (place.layers[0] <= seg[0] < place.layers[1]):
            continue
        holders = plan.segment_holders(seg, place.tp_rank)
        grp = None
        if len(holders) > 1:
            grp = _find(groups, "dp", holders, f"the gradient ring of layers {list(seg)} at TP rank {place.tp_rank}",
                        layers=seg)
        segments.append(Segment(seg, holders, grp))
    return RankView(plan=plan, rank=rank, world_size=world, local_rank=place.local_rank, node=place.node, gpu=place.gpu,
                    replica=place.replica, stage=place.stage, layers=place.layers, tp_rank=place.tp_rank,
                    tp_size=place.tp_size, stage_dp_rank=place.stage_dp_rank, stage_dp_size=st.dp,
                    pp_rank=place.stage, pp_size=len(rep.stages), device=device, backend=backend, tp_ranks=tp_ranks,
                    tp_group=tp_group, pp_prev_ranks=prev_ranks, pp_next_ranks=next_ranks, pp_prev_group=pp_prev,
                    pp_next_group=pp_next, segments=segments, groups=groups)


def _find(groups: List[Group], kind: str, ranks: List[int], what: str, layers=None) -> Group:
    want = sorted(ranks)
    for g in groups:
        if g.kind == kind and sorted(g.ranks) == want and (layers is None or tuple(g.layers) == tuple(layers)):
            return g
    raise RankEnvError(f"comm_groups: the plan has no {kind} group for {what} (ranks {want})")


def group_on_store(store, key: str, index: int, size: int, backend: str, timeout: datetime.timedelta):
    """A process group made afresh on `store` under the prefix `group/KEY` (keep going's epochs,
    a joining rank's TP group: no collective over the launch's world), with `timeout`."""
    sub = dist.PrefixStore(f"group/{key}", store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(sub, index, size, opts)
    return dist.ProcessGroupGloo(sub, index, size, timeout)
