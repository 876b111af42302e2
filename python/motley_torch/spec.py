"""The model spec (`motley model show -o json`, a plan's `model_spec`) and the error every
check of a plan, model or environment raises. Pure Python, and the bottom of the package: it
imports nothing of ours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class PlanError(Exception):
    """A plan, model or environment the rank cannot run with; the message names the field."""


def _need(doc: dict, key: str, where: str):
    if not isinstance(doc, dict) or key not in doc or doc[key] is None:
        raise PlanError(f"{where}.{key}: missing")
    return doc[key]


def _int(doc: dict, key: str, where: str, minimum: int = 0) -> int:
    v = _need(doc, key, where)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise PlanError(f"{where}.{key}: expected an integer >= {minimum}, got {v!r}")
    return v


# ---------------------------------------------------------------------------------------------
# Model spec
# ---------------------------------------------------------------------------------------------


FAMILIES = ("gpt", "llama")
ROPE_SCALINGS = ("linear", "llama3")


def _float(d: dict, key: str, where: str, default: float) -> float:
    v = d.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise PlanError(f"{where}.{key}: expected a positive number, got {v!r}")
    return float(v)


def _rope_scaling(v, where: str) -> Optional[dict]:
    """None, {type: linear, factor} or {type: llama3, factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings} (Llama 3.1)."""
    if v is None:
        return None
    w = f"{where}.rope_scaling"
    if not isinstance(v, dict):
        raise PlanError(f"{w}: expected a mapping with a type ({', '.join(ROPE_SCALINGS)}), got {v!r}")
    kind = v.get("type")
    if kind not in ROPE_SCALINGS:
        raise PlanError(f"{w}.type: {kind!r} is not supported; use one of {', '.join(ROPE_SCALINGS)}")
    out = {"type": kind, "factor": _float(v, "factor", w, None)}
    if kind == "llama3":
        out["low_freq_factor"] = _float(v, "low_freq_factor", w, None)
        out["high_freq_factor"] = _float(v, "high_freq_factor", w, None)
        out["original_max_position_embeddings"] = _int(v, "original_max_position_embeddings", w, 1)
        if out["low_freq_factor"] >= out["high_freq_factor"]:
            raise PlanError(f"{w}.low_freq_factor: {out['low_freq_factor']} must be below high_freq_factor "
                            f"{out['high_freq_factor']}")
    return out


@dataclass(frozen=True)
class ModelSpec:
    """The model spec (`motley model show -o json`). family `gpt`: learned positions, LayerNorm,
    GELU (or SwiGLU when gated_mlp) with biases; family `llama`: RMSNorm (norm_eps), rotary
    embeddings (rope_theta, rope_scaling), grouped-query attention, SwiGLU, no biases but
    q/k/v's when qkv_bias (Qwen2) and the attention output's when o_bias (Llama's
    attention_bias sets both). tie_embeddings: the head is the token embedding's matrix."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    ffn_hidden: int
    kv_heads: int
    gated_mlp: bool
    family: str = "gpt"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    qkv_bias: bool = False
    o_bias: bool = False
    tie_embeddings: bool = False
    sliding_window: Optional[int] = None
    # The longest sequence the model's positions were made for (a Hugging Face config's
    # max_position_embeddings): a bound on seq_len, not the length trained at.
    max_position_embeddings: Optional[int] = None

    @staticmethod
    def from_dict(d: dict, where: str = "model") -> "ModelSpec":
        if not isinstance(d, dict):
            raise PlanError(f"{where}: expected a mapping, got {type(d).__name__}")
        hidden = _int(d, "hidden", where, 1)
        heads = _int(d, "heads", where, 1)
        ffn = d.get("ffn_hidden")
        kv = d.get("kv_heads")
        family = d.get("family") or "gpt"
        if family not in FAMILIES:
            raise PlanError(f"{where}.family: {family!r} is not a model family; use one of {', '.join(FAMILIES)}")
        sw = d.get("sliding_window")
        mpe = d.get("max_position_embeddings")
        spec = ModelSpec(
            name=str(d.get("name", "model")),
            layers=_int(d, "layers", where, 1),
            hidden=hidden,
            heads=heads,
            seq_len=_int(d, "seq_len", where, 1),
            vocab=_int(d, "vocab", where, 1),
            ffn_hidden=4 * hidden if ffn is None else _int(d, "ffn_hidden", where, 1),
            kv_heads=heads if kv is None else _int(d, "kv_heads", where, 1),
            gated_mlp=bool(d.get("gated_mlp", False)),
            family=family,
            norm_eps=_float(d, "norm_eps", where, 1e-5),
            rope_theta=_float(d, "rope_theta", where, 10000.0),
            rope_scaling=_rope_scaling(d.get("rope_scaling"), where),
            qkv_bias=bool(d.get("qkv_bias", False)),
            o_bias=bool(d.get("o_bias", False)),
            tie_embeddings=bool(d.get("tie_embeddings", False)),
            sliding_window=None if sw is None else _int(d, "sliding_window", where, 1),
            max_position_embeddings=None if mpe is None else _int(d, "max_position_embeddings", where, 1),
        )
        if spec.max_position_embeddings is not None and spec.seq_len > spec.max_position_embeddings:
            raise PlanError(f"{where}.seq_len: {spec.seq_len} is more than max_position_embeddings "
                            f"{spec.max_position_embeddings}, the longest sequence the model takes")
        if spec.hidden % spec.heads:
            raise PlanError(f"{where}.heads: {spec.heads} does not divide hidden {spec.hidden}")
        if spec.heads % spec.kv_heads:
            raise PlanError(f"{where}.kv_heads: {spec.kv_heads} does not divide heads {spec.heads}")
        if family == "llama":
            if not spec.gated_mlp:
                raise PlanError(f"{where}.gated_mlp: family llama has a SwiGLU MLP; set gated_mlp: true")
            if (spec.hidden // spec.heads) % 2:
                raise PlanError(f"{where}.heads: head size {spec.hidden // spec.heads} is odd; rotary embeddings "
                                f"need an even head size")
        else:
            if spec.rope_scaling is not None:
                raise PlanError(f"{where}.rope_scaling: only family llama has rotary embeddings; remove it")
            for field in ("qkv_bias", "o_bias"):
                if getattr(spec, field):
                    raise PlanError(f"{where}.{field}: family gpt has biases everywhere already; remove it")
        return spec

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def check_seq_len(self, seq_len: int, where: str = "--seq-len"):
        """Motley's attention is full causal attention: a sliding window under the sequence
        length would compute another model."""
        if self.sliding_window is not None and seq_len > self.sliding_window:
            raise PlanError(f"model.sliding_window: {self.sliding_window} is under the sequence length {seq_len} "
                            f"({where}); Motley has full attention only: train with a sequence length of at most "
                            f"{self.sliding_window}")
