"""The rank library's `Plan` reads the document the Rust types define: every field it reads is
one that the schema generated from those types (docs/plan.schema.json, kept equal to them by
contract's `plan_schema_file_is_the_one_the_types_make`) names at the same place, and a field
the Rust types drop or rename fails here instead of in a rank."""

import json
from typing import Dict, List, Optional, Set, Tuple

import pytest

from launcher import REPO, hand_plan, motley_plan
from motley_torch.plan import Plan
from motley_torch.spec import PlanError

SCHEMA = json.loads((REPO / "docs" / "plan.schema.json").read_text())

Path = Tuple[str, ...]
PIN = ("--tp", "2", "--micro-batch", "2", "--reserve-gib", "0", "--max-stages", "2")


class Recording(dict):
    """A mapping that notes every key read from it, by its path in the document."""

    def __init__(self, items, path: Path, log: Set[Path]):
        super().__init__(items)
        self._path, self._log = path, log

    def _note(self, key):
        self._log.add(self._path + (str(key),))

    def __getitem__(self, key):
        self._note(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._note(key)
        return super().get(key, default)

    def __contains__(self, key):
        self._note(key)
        return super().__contains__(key)


# Maps whose keys are data, not field names (environment variables, node names).
FREE_KEYS = {"env", "node_env", "idle_gpus", "baselines"}


def recorded(v, path: Path, log: Set[Path]):
    if isinstance(v, dict):
        free = path and path[-1] in FREE_KEYS
        inner = {k: (x if free else recorded(x, path + (k,), log)) for k, x in v.items()}
        return inner if free else Recording(inner, path, log)
    if isinstance(v, list):
        return [recorded(x, path + ("[]",), log) for x in v]
    return v


def _deref(node: dict) -> dict:
    while "$ref" in node:
        node = SCHEMA["$defs"][node["$ref"].split("/")[-1]]
    return node


def _branches(node: dict) -> List[dict]:
    """The object schemas a value at `node` may take (through refs, anyOf, oneOf)."""
    node = _deref(node)
    subs = node.get("anyOf") or node.get("oneOf")
    if subs:
        return [b for s in subs for b in _branches(s)]
    return [node]


def schema_at(path: Path) -> Optional[List[dict]]:
    nodes = [SCHEMA]
    for part in path:
        nxt = []
        for n in nodes:
            for b in _branches(n):
                if part == "[]":
                    if isinstance(b.get("items"), dict):
                        nxt.append(b["items"])
                elif part in (b.get("properties") or {}):
                    nxt.append(b["properties"][part])
        if not nxt:
            return None
        nodes = nxt
    return nodes


def read_fields(doc: dict) -> Set[Path]:
    log: Set[Path] = set()
    Plan(recorded(doc, (), log))
    return log


def plans() -> Dict[str, dict]:
    """Documents as the planner writes them (RDMA rings with per-node settings, pipelines,
    uneven replicas, a llama with rotary scaling) and one written by hand."""
    return {
        "holmes": motley_plan("holmes-hybrid-4x2.yaml", "tiny4.yaml", 8, *PIN),
        "mixed": motley_plan("mixed-3x2.yaml", "tiny-llama.yaml", 8, *PIN, "--zero1"),
        "by-hand": hand_plan(dict(name="t", layers=4, hidden=32, heads=4, seq_len=8, vocab=64), 8, 2, [
            dict(micro_batches=3, stages=[dict(layers=[0, 1], tp=1, dp=2, gpus=[("a", 0), ("a", 1)]),
                                          dict(layers=[1, 4], tp=1, dp=1, gpus=[("b", 0)])]),
            dict(micro_batches=1, stages=[dict(layers=[0, 4], tp=1, dp=1, gpus=[("c", 0)])]),
        ], node_kind={"a": "ib", "b": "ib"}),
    }


@pytest.fixture(scope="module")
def documents():
    return plans()


def test_every_field_the_rank_library_reads_is_in_the_rust_schema(documents):
    read: Set[Path] = set()
    for doc in documents.values():
        read |= read_fields(doc)
    # The reader's main fields were seen, so the check below checked something.
    for must in [("global_batch",), ("replicas", "[]", "stages", "[]", "gpus", "[]", "node"), ("comm_groups", "[]", "kind"),
                 ("model_spec", "layers"), ("comm_groups", "[]", "transport")]:
        assert must in read, f"the reader did not read {'.'.join(must)}: {sorted(read)}"
    missing = sorted(".".join(p) for p in read if schema_at(p) is None)
    assert not missing, f"the rank library reads fields the plan document's Rust types do not have: {missing}"


def test_the_planners_documents_hold_only_fields_of_the_schema(documents):
    def walk(v, path: Path, out: List[str]):
        if isinstance(v, dict) and not (path and path[-1] in FREE_KEYS):
            for k, x in v.items():
                if schema_at(path + (k,)) is None:
                    out.append(".".join(path + (k,)))
                walk(x, path + (k,), out)
        elif isinstance(v, list):
            for x in v:
                walk(x, path + ("[]",), out)

    for name in ("holmes", "mixed"):
        extra: List[str] = []
        walk(documents[name], (), extra)
        assert not extra, f"{name}: the planner wrote fields the schema lacks: {sorted(set(extra))}"


def test_fields_the_schema_requires_are_required_by_the_reader_too(documents):
    # Where the schema says a document is not a plan without a field, neither is it to a rank.
    doc = documents["holmes"]
    required = [((), f) for f in SCHEMA["required"]]
    required += [(("replicas", 0), f) for f in _deref(schema_at(("replicas", "[]"))[0]).get("required", [])]
    required += [(("replicas", 0, "stages", 0), f) for f in
                 _deref(schema_at(("replicas", "[]", "stages", "[]"))[0]).get("required", [])
                 # A rank needs no GPU type's name: its device is its own.
                 if f != "gpu"]
    assert len(required) >= 8, required
    for where, field in required:
        bad = json.loads(json.dumps(doc))
        parent = bad
        for p in where:
            parent = parent[p]
        del parent[field]
        with pytest.raises(PlanError) as e:
            Plan(bad)
        assert field in str(e.value), f"{where}.{field}: {e.value}"
