"""Hugging Face models in and out: config.json -> ModelSpec, HF tensor names <-> Motley's, and
reading one rank's slices of a safetensors checkpoint lazily.

Pure Python but for `read_rank_into` (torch) and `write_hf` (safetensors). transformers is never imported:
it is a test-only dependency (the tests build random-init models with it and compare).

The mapping (transformers' modeling_llama / modeling_qwen2 / modeling_mistral):

    model.embed_tokens.weight                        embed.weight
    model.layers.N.input_layernorm.weight            layers.N.ln1.weight
    model.layers.N.self_attn.{q,k,v,o}_proj.{w,b}    layers.N.attn.{q,k,v,o}.{w,b}
    model.layers.N.post_attention_layernorm.weight   layers.N.ln2.weight
    model.layers.N.mlp.{gate,up,down}_proj.weight    layers.N.mlp.{gate,up,down}.weight
    model.norm.weight                                ln_f.weight
    lm_head.weight                                   head.weight (absent when tied: embed_tokens)

q and k keep HF's layout: Motley's rotary embedding is HF's rotate-half form (each head's first
half of dimensions paired with its second half), so no permutation is needed, and a head's rows
stay contiguous, which is what the TP split by heads (granule head_dim) needs.
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, Iterable, List, Tuple

from ..spec import ModelSpec, PlanError

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3")
# A Hugging Face model's training sequence length unless a plan or --seq-len says another: at
# most this and its max_position_embeddings (and sliding window).
DEFAULT_SEQ_LEN = 4096
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_SHARD_BYTES = 5 * 10**9


class HFError(PlanError):
    """A Hugging Face directory, config or weight file Motley cannot use; names file and field."""


def config_path(ref: str) -> str:
    return os.path.join(ref, "config.json") if os.path.isdir(ref) else ref


def is_hf_model(ref: str) -> bool:
    """A directory holding config.json, or a path to a file named config.json."""
    if os.path.isdir(ref):
        return os.path.isfile(os.path.join(ref, "config.json"))
    return os.path.basename(ref) == "config.json" and os.path.isfile(ref)


def _cfg_int(cfg: dict, key: str, where: str, default=None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise HFError(f"{where}: {key}: expected a positive integer, got {v!r}")
    return v


def _num(d: dict, key: str, where: str) -> float:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise HFError(f"{where}: {key}: expected a positive number, got {v!r}")
    return float(v)


def spec_from_config(cfg: dict, name: str, where: str) -> ModelSpec:
    """The Motley spec of a transformers config.json (both spellings of RoPE: `rope_theta` and
    `rope_scaling` at the top level, and transformers 5's `rope_parameters`)."""
    if not isinstance(cfg, dict):
        raise HFError(f"{where}: expected a JSON object")
    archs = cfg.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch not in SUPPORTED:
        raise HFError(f"{where}: architectures: {archs!r} is not supported; Motley trains {', '.join(SUPPORTED)}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise HFError(f"{where}: hidden_act: {act!r}; the llama family's SwiGLU uses silu")
    if cfg.get("mlp_bias"):
        raise HFError(f"{where}: mlp_bias: true is not supported (the llama family's MLP has no biases)")
    hidden = _cfg_int(cfg, "hidden_size", where)
    heads = _cfg_int(cfg, "num_attention_heads", where)
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim * heads != hidden:
        raise HFError(f"{where}: head_dim: {head_dim} is not hidden_size / num_attention_heads "
                      f"({hidden} / {heads}); Motley needs head_dim * heads == hidden")
    rp = cfg.get("rope_parameters")
    rs = cfg.get("rope_scaling")
    rope_key = "rope_parameters" if isinstance(rp, dict) else "rope_scaling"
    rope = rp if isinstance(rp, dict) else (rs if isinstance(rs, dict) else {})
    theta = cfg.get("rope_theta")
    if theta is None:
        theta = rope.get("rope_theta", 10000.0)
    kind = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
    if kind not in ROPE_TYPES:
        raise HFError(f"{where}: {rope_key}.rope_type: {kind!r} is not supported; use one of {', '.join(ROPE_TYPES)}")
    scaling = None
    if kind == "linear":
        scaling = {"type": "linear", "factor": _num(rope, "factor", f"{where}: {rope_key}")}
    elif kind == "llama3":
        w = f"{where}: {rope_key}"
        scaling = {"type": "llama3", "factor": _num(rope, "factor", w),
                   "low_freq_factor": _num(rope, "low_freq_factor", w),
                   "high_freq_factor": _num(rope, "high_freq_factor", w),
                   "original_max_position_embeddings": _cfg_int(rope, "original_max_position_embeddings", w)}
    window = None
    if arch == "MistralForCausalLM":
        window = cfg.get("sliding_window")
    elif arch == "Qwen2ForCausalLM" and cfg.get("use_sliding_window"):
        window = cfg.get("sliding_window")
    max_pos = _cfg_int(cfg, "max_position_embeddings", where, 2048)
    # The length trained at when nothing says otherwise, as the planner's
    # (solver/src/model/hf.rs DEFAULT_SEQ_LEN): a config says how long a sequence the model can
    # take, not how long the sequences it is fine-tuned on are.
    seq = min(max_pos, DEFAULT_SEQ_LEN)
    if window is not None:
        seq = min(seq, _cfg_int(cfg, "sliding_window", where))
    # Llama's attention_bias biases q, k, v and o alike (modeling_llama.py's LlamaAttention);
    # Qwen2 biases q, k and v always and o never (modeling_qwen2.py); Mistral's attention has no
    # bias whatever its config says (modeling_mistral.py).
    attention_bias = arch == "LlamaForCausalLM" and bool(cfg.get("attention_bias", False))
    qkv_bias = arch == "Qwen2ForCausalLM" or attention_bias
    doc = {
        "name": name, "family": "llama", "layers": _cfg_int(cfg, "num_hidden_layers", where), "hidden": hidden,
        "heads": heads, "kv_heads": _cfg_int(cfg, "num_key_value_heads", where, heads), "seq_len": seq,
        "vocab": _cfg_int(cfg, "vocab_size", where), "ffn_hidden": _cfg_int(cfg, "intermediate_size", where),
        "gated_mlp": True, "norm_eps": cfg.get("rms_norm_eps", 1e-6), "rope_theta": theta, "rope_scaling": scaling,
        "qkv_bias": qkv_bias, "o_bias": attention_bias, "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "sliding_window": window, "max_position_embeddings": max_pos,
    }
    return ModelSpec.from_dict(doc, where=where)


def spec_from_hf(ref: str) -> ModelSpec:
    path = config_path(ref)
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise HFError(f"{path}: cannot read a JSON config ({e})")
    name = os.path.basename(os.path.dirname(os.path.abspath(path))) or "model"
    return spec_from_config(cfg, name, path)


def config_from_spec(spec: ModelSpec) -> dict:
    """A LlamaForCausalLM (attention_bias: q/k/v and o biases) or Qwen2ForCausalLM (q/k/v
    biases, none on o) config.json of the spec, in transformers 5's spelling, which older
    readers of `rope_theta` also get."""
    if spec.family != "llama":
        raise HFError(f"model.family: {spec.family}; only family llama exports to Hugging Face")
    if spec.o_bias and not spec.qkv_bias:
        raise HFError("model.o_bias: an attention output bias without q/k/v biases has no Hugging Face "
                      "architecture (Llama's attention_bias biases all four, Qwen2 q/k/v only); it cannot be "
                      "exported")
    qwen = spec.qkv_bias and not spec.o_bias
    rope = {"rope_theta": spec.rope_theta, "rope_type": "default"}
    if spec.rope_scaling:
        rope.update({k: v for k, v in spec.rope_scaling.items() if k != "type"})
        rope["rope_type"] = spec.rope_scaling["type"]
    cfg = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "hidden_act": "silu", "hidden_size": spec.hidden, "intermediate_size": spec.ffn_hidden,
        "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.hidden // spec.heads, "max_position_embeddings": spec.max_position_embeddings or spec.seq_len, "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta, "rope_parameters": rope, "tie_word_embeddings": spec.tie_embeddings,
        "vocab_size": spec.vocab, "torch_dtype": "float32", "initializer_range": 0.02,
    }
    if spec.rope_scaling:
        cfg["rope_scaling"] = dict(rope)
    if qwen:
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = None
    else:
        cfg["attention_bias"] = spec.o_bias
        cfg["mlp_bias"] = False
    return cfg


# ---- names ----------------------------------------------------------------------------------

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_LAYER_MAP = {
    "ln1.weight": "input_layernorm.weight", "ln2.weight": "post_attention_layernorm.weight",
    "attn.q.weight": "self_attn.q_proj.weight", "attn.k.weight": "self_attn.k_proj.weight",
    "attn.v.weight": "self_attn.v_proj.weight", "attn.o.weight": "self_attn.o_proj.weight",
    "attn.q.bias": "self_attn.q_proj.bias", "attn.k.bias": "self_attn.k_proj.bias",
    "attn.v.bias": "self_attn.v_proj.bias", "attn.o.bias": "self_attn.o_proj.bias",
    "mlp.gate.weight": "mlp.gate_proj.weight", "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}


def hf_name(name: str, spec: ModelSpec) -> str:
    """The transformers name of a Motley parameter (`head.weight` of a tied model reads
    embed_tokens)."""
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    if name == "ln_f.weight":
        return "model.norm.weight"
    if name == "head.weight":
        return "model.embed_tokens.weight" if spec.tie_embeddings else "lm_head.weight"
    m = _LAYER.match(name)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
    raise HFError(f"parameter {name}: has no Hugging Face name (family {spec.family})")


# ---- reading one rank's slices --------------------------------------------------------------


def weight_files(directory: str) -> Dict[str, str]:
    """HF tensor name -> the safetensors file (absolute) holding it: `model.safetensors`, or
    the shards `model.safetensors.index.json` lists (each checked to exist)."""
    index = os.path.join(directory, INDEX)
    single = os.path.join(directory, SINGLE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                wm = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise HFError(f"{index}: weight_map: cannot read it ({e!r})")
        out = {}
        for name, shard in wm.items():
            if not isinstance(shard, str) or os.path.basename(shard) != shard:
                raise HFError(f"{index}: weight_map.{name}: {shard!r} is not a file name in {directory}")
            path = os.path.join(directory, shard)
            if not os.path.isfile(path):
                raise HFError(f"{index}: weight_map.{name}: shard {shard} is missing from {directory}; "
                              f"copy the whole model directory")
            out[name] = path
        return out
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    raise HFError(f"{directory}: neither {SINGLE} nor {INDEX}; save the model with save_pretrained "
                  f"(safetensors)")


_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def _header(path: str) -> Tuple[dict, int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets) and where its data
    starts: an 8-byte little-endian length, then that much JSON (the format's whole spec)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise HFError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        n = int.from_bytes(raw, "little")
        if n > 100 * 2**20:
            raise HFError(f"{path}: header of {n} bytes: not a safetensors file")
        try:
            head = json.loads(f.read(n))
        except ValueError as e:
            raise HFError(f"{path}: header is not JSON ({e}): not a safetensors file")
    head.pop("__metadata__", None)
    return head, 8 + n


def _read_rows(f, base: int, row_bytes: int, r0: int, r1: int, col0: int, col1: int, elem: int, dest, src_dtype):
    """Rows [r0, r1) of a 2-D (or 1-D: one row) tensor, bytes [col0, col1) of each row, into
    `dest` (a tensor of shape [r1 - r0, (col1 - col0) / elem] or its 1-D equivalent), reading
    through a buffer of at most 16 MiB and converting to dest's dtype as it goes."""
    import torch

    want = col1 - col0
    step = max(1, (16 << 20) // max(row_bytes, 1))
    flat = dest.view(r1 - r0, want // elem) if dest.dim() != 1 or r1 - r0 != 1 else dest.view(1, -1)
    direct = src_dtype == dest.dtype and want == row_bytes
    r = r0
    while r < r1:
        k = min(step, r1 - r)
        if direct:
            # Contiguous rows of the right type: straight into the parameter's memory.
            view = flat[r - r0 : r - r0 + k]
            mv = memoryview(view.view(torch.uint8).numpy()).cast("B")
            f.seek(base + r * row_bytes)
            if f.readinto(mv) != len(mv):
                raise HFError(f"{f.name}: shorter than its header says")
        else:
            buf = bytearray(k * row_bytes)
            f.seek(base + r * row_bytes)
            if f.readinto(buf) != len(buf):
                raise HFError(f"{f.name}: shorter than its header says")
            rows = torch.frombuffer(buf, dtype=torch.uint8).view(k, row_bytes)[:, col0:col1]
            flat[r - r0 : r - r0 + k].copy_(rows.contiguous().view(src_dtype).view(k, want // elem))
        r += k


# What transformers' checkpoints may hold that is no weight: each layer's rotary inverse
# frequencies, which older transformers versions saved as a buffer beside the weights and which
# the config determines (Motley computes them from rope_theta and rope_scaling, as transformers
# itself now does: modeling_llama.py's LlamaRotaryEmbedding registers inv_freq with
# persistent=False).
_NOT_WEIGHTS = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_SHOWN = 8


def check_all_used(directory: str, spec: ModelSpec, names: Iterable[str], layers: range, first: bool, last: bool):
    """Refuse a checkpoint holding a tensor the model does not use: dropped, it would leave
    Motley training another model than the weights' (a bias the config does not declare). A
    rank reads only its part, so it answers for the tensors of its `layers`, of the embedding
    when `first` and of the final norm and head when `last` (`names`: its parameters, whose
    tensors it reads), and, like every rank, for those of no layer the model has. Names only:
    the shards' headers, every shard's (transformers loads each tensor of each shard, listed
    in the index or not)."""
    files = weight_files(directory)
    held = set(files)
    for path in sorted(set(files.values())):
        held.update(_header(path)[0])
    used = {hf_name(n, spec) for n in names}
    left = []
    for name in sorted(held - used):
        if _NOT_WEIGHTS.match(name):
            continue
        m = _HF_LAYER.match(name)
        if m:
            ours = int(m.group(1)) in layers or int(m.group(1)) >= spec.layers
        elif name.startswith("model.embed_tokens."):
            ours = first
        elif name.startswith(("model.norm.", "lm_head.")):
            ours = last
        else:
            ours = True
        if ours and not (name == "lm_head.weight" and spec.tie_embeddings
                         and _same_tensor(files, name, "model.embed_tokens.weight")):
            left.append(name)
    if left:
        shown = ", ".join(left[:_SHOWN]) + (f" and {len(left) - _SHOWN} more" if len(left) > _SHOWN else "")
        raise HFError(f"{directory}: the weights hold {len(left)} tensor{'s' if len(left) != 1 else ''} the model "
                      f"does not use: {shown}; config.json does not describe these weights, and Motley uses every "
                      f"tensor or refuses (one left out trains another model than the weights'): declare them in "
                      f"config.json (attention_bias: true for Llama's q/k/v/o biases, num_hidden_layers for more "
                      f"layers, tie_word_embeddings: false for a head of its own), or remove them from the weights")


def _same_tensor(files: Dict[str, str], a: str, b: str) -> bool:
    """Whether tensors `a` and `b` hold the same bytes (dtype and shape too), read 16 MiB at a
    time. transformers ties a head to the embedding when the config says so and a checkpoint
    holding both holds them equal, and unties them otherwise (modeling_utils.py, tie_weights)."""
    if a not in files or b not in files:
        return False
    (ha, base_a), (hb, base_b) = _header(files[a]), _header(files[b])
    ia, ib = ha.get(a), hb.get(b)
    if ia is None or ib is None or (ia.get("dtype"), ia.get("shape")) != (ib.get("dtype"), ib.get("shape")):
        return False
    (a0, a1), (b0, b1) = ia["data_offsets"], ib["data_offsets"]
    if a1 - a0 != b1 - b0:
        return False
    with open(files[a], "rb") as fa, open(files[b], "rb") as fb:
        fa.seek(base_a + a0)
        fb.seek(base_b + b0)
        left = a1 - a0
        while left:
            n = min(left, 16 << 20)
            if fa.read(n) != fb.read(n):
                return False
            left -= n
    return True


def read_rank_into(directory: str, spec: ModelSpec, wanted: Iterable[Tuple[str, Tuple[int, ...], tuple, object]]):
    """Fill each wanted parameter with its part of the Hugging Face weights: `wanted` is
    (motley name, full shape, (axis, start, end) of this rank's part or None for all of it,
    destination tensor on the CPU). Only those bytes are read, with plain reads into the
    destination (through a 16 MiB buffer when rows must be cut or the type converted): no
    file is memory-mapped, so the rank's RSS holds its parameters and one buffer, never a
    tensor twice. (safetensors' own reader maps the file, and every page it touches counts in
    the RSS beside the copy it returns.)"""
    import torch

    files = weight_files(directory)
    headers: Dict[str, Tuple[dict, int]] = {}
    for name, full_shape, part, dest in wanted:
        hf = hf_name(name, spec)
        path = files.get(hf)
        if path is None:
            raise HFError(f"{directory}: tensor {hf} (Motley {name}) is missing from the weights")
        if path not in headers:
            headers[path] = _header(path)
        head, base = headers[path]
        info = head.get(hf)
        if info is None:
            raise HFError(f"{path}: no tensor {hf}, which the index says it holds")
        shape = tuple(info.get("shape", ()))
        if shape != tuple(full_shape):
            raise HFError(f"{path}: {hf} has shape {list(shape)}, the model spec needs {list(full_shape)}; "
                          f"is config.json the weights' config?")
        dt = _ST_DTYPES.get(info.get("dtype"))
        if dt is None:
            raise HFError(f"{path}: {hf} has dtype {info.get('dtype')}; Motley reads {', '.join(_ST_DTYPES)}")
        src = getattr(torch, dt)
        elem = torch.empty((), dtype=src).element_size()
        begin, end = info["data_offsets"]
        numel = 1
        for x in shape:
            numel *= x
        if end - begin != numel * elem:
            raise HFError(f"{path}: {hf}: data_offsets span {end - begin} bytes, its shape and dtype {numel * elem}")
        rows = shape[0] if len(shape) == 2 else 1
        row_bytes = (end - begin) // rows
        r0, r1, c0, c1 = 0, rows, 0, row_bytes
        if part is not None:
            axis, a, b = part
            if len(shape) == 1:
                c0, c1 = a * elem, b * elem
            elif axis == 0:
                r0, r1 = a, b
            else:
                c0, c1 = a * elem, b * elem
        with open(path, "rb") as f:
            with torch.no_grad():
                _read_rows(f, base + begin, row_bytes, r0, r1, c0, c1, elem, dest, src)


# ---- writing ----------------------------------------------------------------------------------


def write_hf(out_dir: str, spec: ModelSpec, tensors: Iterable[Tuple[str, "object"]],
             max_shard_bytes: int = MAX_SHARD_BYTES) -> List[str]:
    """Write config.json, safetensors shards of at most `max_shard_bytes` and the index, from
    (motley name, full tensor) pairs streamed in order (at most one shard held at a time). Files
    go through temporary names and are renamed at the end. Returns the shard names."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    cur: Dict[str, object] = {}
    size = 0
    tmp_names: List[str] = []
    weight_map: Dict[str, int] = {}
    total = 0

    def flush():
        nonlocal cur, size
        if not cur:
            return
        k = len(tmp_names)
        tmp = os.path.join(out_dir, f".shard-{k}.safetensors.tmp")
        save_file({n: t.contiguous() for n, t in cur.items()}, tmp, metadata={"format": "pt"})
        for n in cur:
            weight_map[n] = k
        tmp_names.append(tmp)
        cur, size = {}, 0

    for name, t in tensors:
        if spec.tie_embeddings and name == "head.weight":
            continue
        hf = hf_name(name, spec)
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > max_shard_bytes:
            flush()
        cur[hf] = t
        size += nbytes
        total += nbytes
    flush()
    n = len(tmp_names)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for tmp, final in zip(tmp_names, names):
        os.replace(tmp, os.path.join(out_dir, final))
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {k: names[i] for k, i in sorted(weight_map.items())}}
        _write_json(os.path.join(out_dir, INDEX), index)
    elif os.path.exists(os.path.join(out_dir, INDEX)):
        os.remove(os.path.join(out_dir, INDEX))
    _write_json(os.path.join(out_dir, "config.json"), config_from_spec(spec))
    return names


def _write_json(path: str, doc: dict):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def motley_order(spec: ModelSpec) -> List[str]:
    """Motley's parameter names in model order (embed, layers, final norm, head)."""
    names = ["embed.weight"]
    for i in range(spec.layers):
        p = f"layers.{i}."
        names += [p + "ln1.weight", p + "attn.q.weight"]
        if spec.qkv_bias:
            names.append(p + "attn.q.bias")
        names.append(p + "attn.k.weight")
        if spec.qkv_bias:
            names.append(p + "attn.k.bias")
        names.append(p + "attn.v.weight")
        if spec.qkv_bias:
            names.append(p + "attn.v.bias")
        names.append(p + "attn.o.weight")
        if spec.o_bias:
            names.append(p + "attn.o.bias")
        names += [p + "ln2.weight", p + "mlp.gate.weight", p + "mlp.up.weight", p + "mlp.down.weight"]
    names.append("ln_f.weight")
    if not spec.tie_embeddings:
        names.append("head.weight")
    return names
