"""The plan document (`motley plan -o json`, the file at MOTLEY_PLAN) as a rank sees it.

Pure Python (no torch): rank numbering, layer segments and the data split; the model spec it
carries is `spec.ModelSpec`.

Rank numbering (coordinator/src/planning/mod.rs `ranks_of`): replicas in order, stages in order,
each stage's `gpus` in order; a stage's GPUs are listed TP group by TP group (dp-major), so a
GPU's position p in its stage gives TP rank p % tp and stage-dp rank p // tp.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple


from .spec import ModelSpec, PlanError, _int, _need


# ---------------------------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------------------------

Gpu = Tuple[str, int]


@dataclass
class Stage:
    replica: int
    index: int
    layers: Tuple[int, int]
    gpu_type: str
    tp: int
    dp: int
    gpus: List[Gpu]
    ranks: List[int] = field(default_factory=list)

    def tp_group_ranks(self, d: int) -> List[int]:
        return self.ranks[d * self.tp : (d + 1) * self.tp]


@dataclass
class Replica:
    index: int
    samples: int
    micro_batches: int
    stages: List[Stage]
    sample_offset: int = 0


@dataclass
class CommGroup:
    index: int
    kind: str
    gpus: List[Gpu]
    ranks: List[int]
    env: Dict[str, str]
    node_env: Dict[str, Dict[str, str]]
    nccl_net: Optional[str]
    replica: Optional[int]
    stage: Optional[int]
    layers: Tuple[int, int]
    transport: Optional[str] = None


@dataclass(frozen=True)
class RankPlace:
    rank: int
    node: str
    gpu: int
    local_rank: int
    replica: int
    stage: int
    layers: Tuple[int, int]
    tp_rank: int
    tp_size: int
    stage_dp_rank: int
    stage_dp_size: int


def _gpu(g, where: str) -> Gpu:
    if not isinstance(g, dict):
        raise PlanError(f"{where}: expected {{node, index}}, got {g!r}")
    node = _need(g, "node", where)
    return (str(node), _int(g, "index", where))


def _env(d, where: str) -> Dict[str, str]:
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise PlanError(f"{where}: expected a mapping")
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in d.items()}


class Plan:
    def __init__(self, doc: dict, model: Optional[ModelSpec] = None, source: str = "plan"):
        if not isinstance(doc, dict):
            raise PlanError(f"{source}: not a JSON object")
        self.doc = doc
        self.source = source
        w = source
        self.global_batch = _int(doc, "global_batch", w, 1)
        self.micro_batch = _int(doc, "micro_batch", w, 1)
        self.seq_len = _int(doc, "seq_len", w, 1)
        # The planner's choice of compute type (`motley plan --precision auto`); None in plans
        # from before it was recorded.
        self.precision = doc.get("precision")
        # Full activation recomputation as the plan was priced with (`--recompute`).
        self.recompute = bool(doc.get("recompute", False))
        # Activations priced as compiled blocks save them (`motley plan`'s default) or eager
        # ones (`--eager`; absent, false, in documents from before it was added).
        self.compiled = bool(doc.get("compiled", False))
        # Optimizer state sharded over each segment's dp ring as priced (`--zero1`).
        self.zero1 = bool(doc.get("zero1", False))
        if self.precision not in (None, "bf16", "fp16", "fp32"):
            raise PlanError(f"{w}.precision: {self.precision!r} is not bf16, fp16 or fp32")
        if doc.get("model_spec") is not None:
            self.model = ModelSpec.from_dict(doc["model_spec"], where=f"{w}.model_spec")
        elif model is not None:
            self.model = model
        else:
            raise PlanError(f"{w}.model_spec: missing; pass --model (a model YAML file) for plans without it")
        reps = _need(doc, "replicas", w)
        if not isinstance(reps, list) or not reps:
            raise PlanError(f"{w}.replicas: expected a non-empty list")
        self.replicas: List[Replica] = []
        self.ranks: List[RankPlace] = []
        self.rank_of: Dict[Gpu, int] = {}
        local: Dict[str, int] = {}
        offset = 0
        L = self.model.layers
        tps = set()
        for ri, r in enumerate(reps):
            rw = f"{w}.replicas[{ri}]"
            samples = _int(r, "samples", rw, 0)
            mbs = _int(r, "micro_batches", rw, 0)
            if samples != mbs * self.micro_batch:
                raise PlanError(f"{rw}.samples: {samples} != micro_batches {mbs} * micro_batch {self.micro_batch}")
            stages = _need(r, "stages", rw)
            if not isinstance(stages, list) or not stages:
                raise PlanError(f"{rw}.stages: expected a non-empty list")
            rep = Replica(ri, samples, mbs, [], offset)
            offset += samples
            prev_end = 0
            for si, s in enumerate(stages):
                sw = f"{rw}.stages[{si}]"
                lay = _need(s, "layers", sw)
                if not (isinstance(lay, list) and len(lay) == 2 and all(isinstance(x, int) for x in lay)):
                    raise PlanError(f"{sw}.layers: expected [start, end)")
                if lay[0] != prev_end or lay[1] <= lay[0]:
                    raise PlanError(f"{sw}.layers: {lay} does not continue at layer {prev_end}")
                prev_end = lay[1]
                tp = _int(s, "tp", sw, 1)
                dp = _int(s, "dp", sw, 1)
                tps.add(tp)
                gpus = [_gpu(g, f"{sw}.gpus[{i}]") for i, g in enumerate(_need(s, "gpus", sw))]
                if len(gpus) != tp * dp:
                    raise PlanError(f"{sw}.gpus: {len(gpus)} GPUs, expected tp {tp} * dp {dp}")
                if self.micro_batch % dp:
                    raise PlanError(f"{sw}.dp: {dp} does not divide micro_batch {self.micro_batch}")
                st = Stage(ri, si, (lay[0], lay[1]), str(s.get("gpu", "")), tp, dp, gpus)
                for p, g in enumerate(gpus):
                    if g in self.rank_of:
                        raise PlanError(f"{sw}.gpus[{p}]: GPU {g[0]}:{g[1]} is already used by rank {self.rank_of[g]}")
                    rank = len(self.ranks)
                    self.rank_of[g] = rank
                    st.ranks.append(rank)
                    lr = local.get(g[0], 0)
                    local[g[0]] = lr + 1
                    self.ranks.append(RankPlace(rank, g[0], g[1], lr, ri, si, st.layers, p % tp, tp, p // tp, dp))
                rep.stages.append(st)
            if prev_end != L:
                raise PlanError(f"{rw}.stages: cover layers [0, {prev_end}), the model has {L}")
            self.replicas.append(rep)
        if offset != self.global_batch:
            raise PlanError(f"{w}.replicas: samples sum to {offset}, global_batch is {self.global_batch}")
        if len(tps) != 1:
            raise PlanError(f"{w}.replicas: stages mix tensor-parallel degrees {sorted(tps)}; one tp per plan")
        self.tp = tps.pop()
        self.local_world_size = dict(local)
        self.comm_groups: List[CommGroup] = []
        for i, g in enumerate(doc.get("comm_groups") or []):
            gw = f"{w}.comm_groups[{i}]"
            kind = _need(g, "kind", gw)
            if kind not in ("tp", "pp", "dp"):
                raise PlanError(f"{gw}.kind: {kind!r} is not tp, pp or dp")
            gpus = [_gpu(x, f"{gw}.gpus[{j}]") for j, x in enumerate(_need(g, "gpus", gw))]
            ranks = []
            for x in gpus:
                if x not in self.rank_of:
                    raise PlanError(f"{gw}.gpus: GPU {x[0]}:{x[1]} is in no stage of the plan")
                ranks.append(self.rank_of[x])
            lay = g.get("layers") or [0, 0]
            node_env = {str(n): _env(e, f"{gw}.node_env.{n}") for n, e in (g.get("node_env") or {}).items()}
            self.comm_groups.append(
                CommGroup(i, kind, gpus, ranks, _env(g.get("env"), f"{gw}.env"), node_env, g.get("nccl_net"),
                          g.get("replica"), g.get("stage"), (int(lay[0]), int(lay[1])), g.get("transport"))
            )

    @staticmethod
    def load(path: str, model: Optional[ModelSpec] = None) -> "Plan":
        try:
            with open(path) as f:
                doc = json.load(f)
        except OSError as e:
            raise PlanError(f"plan file {path}: {e.strerror}")
        except json.JSONDecodeError as e:
            raise PlanError(f"plan file {path}: not JSON ({e})")
        return Plan(doc, model, source=f"plan {path}")

    # -- structure --------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def stage_of(self, rank: int) -> Stage:
        p = self.ranks[rank]
        return self.replicas[p.replica].stages[p.stage]

    def segments(self) -> List[Tuple[int, int]]:
        """Layer segments: cut at every stage boundary of every replica (the dp groups' layers)."""
        cuts = {0, self.model.layers}
        for r in self.replicas:
            for s in r.stages:
                cuts.add(s.layers[0])
        c = sorted(cuts)
        return list(zip(c[:-1], c[1:]))

    def segment_holders(self, seg: Tuple[int, int], tp_rank: int) -> List[int]:
        """Global ranks holding segment `seg` at TP rank `tp_rank`: the expected dp ring."""
        out = []
        for r in self.replicas:
            for s in r.stages:
                if s.layers[0] <= seg[0] < s.layers[1]:
                    out.extend(s.ranks[d * s.tp + tp_rank] for d in range(s.dp))
        return out

    def groups_of_gpu(self, node: str, gpu: int) -> List[CommGroup]:
        return [g for g in self.comm_groups if (node, gpu) in g.gpus]

    # -- data split ---------------------------------------------------------------------------

    def dp_slice(self, stage: Stage, d: int) -> Tuple[int, int]:
        """Rows [a, b) of a micro-batch that stage-dp rank d of `stage` processes."""
        n = self.micro_batch // stage.dp
        return (d * n, (d + 1) * n)

    def micro_batch_rows(self, replica: int, k: int) -> Tuple[int, int]:
        """Rows [a, b) of the global batch that micro-batch k of `replica` covers."""
        r = self.replicas[replica]
        a = r.sample_offset + k * self.micro_batch
        return (a, a + self.micro_batch)

    def rank_samples(self, rank: int) -> List[Tuple[int, int]]:
        """Global-batch rows a rank processes, one range per micro-batch."""
        p = self.ranks[rank]
        st = self.stage_of(rank)
        lo, hi = self.dp_slice(st, p.stage_dp_rank)
        out = []
        for k in range(self.replicas[p.replica].micro_batches):
            a, _ = self.micro_batch_rows(p.replica, k)
            out.append((a + lo, a + hi))
        return out

    def hop_pairs(self, replica: int, stage: int) -> List[Tuple[int, int, Tuple[int, int]]]:
        """Pipeline hop stage -> stage+1 of `replica`: (sender dp, receiver dp, rows [a, b) of the
        micro-batch) for every pair of dp-slices whose rows overlap, in (sender, receiver) order."""
        r = self.replicas[replica]
        s, t = r.stages[stage], r.stages[stage + 1]
        out = []
        for d in range(s.dp):
            a0, a1 = self.dp_slice(s, d)
            for e in range(t.dp):
                b0, b1 = self.dp_slice(t, e)
                lo, hi = max(a0, b0), min(a1, b1)
                if lo < hi:
                    out.append((d, e, (lo, hi)))
        return out


def group_entries_for_gpu(plan_doc: dict, node: str, gpu: int) -> List[dict]:
    """MOTLEY_NCCL_GROUPS for one GPU, as contract/src/groups.rs writes it (with `index`, `gpus`
    and `layers`): the groups holding the GPU, in plan order, `node_env` merged into `env`."""
    out = []
    for i, g in enumerate(plan_doc.get("comm_groups") or []):
        if not any(m.get("node") == node and m.get("index") == gpu for m in g.get("gpus") or []):
            continue
        env = {}
        for src in (g.get("env") or {}, (g.get("node_env") or {}).get(node) or {}):
            for k, v in src.items():
                env[k] = v if isinstance(v, str) else json.dumps(v)
        out.append({"kind": g.get("kind"), "replica": g.get("replica"), "stage": g.get("stage"),
                    "nccl_net": g.get("nccl_net"), "env": env, "index": i, "gpus": g.get("gpus"),
                    "layers": g.get("layers")})
    return out


def common_env(entries: Sequence[dict]) -> Dict[str, str]:
    """Keys every entry sets to the same value (the agent sets them at process start)."""
    if not entries:
        return {}
    first, rest = entries[0]["env"], entries[1:]
    return {k: v for k, v in first.items() if all(e["env"].get(k) == v for e in rest)}
