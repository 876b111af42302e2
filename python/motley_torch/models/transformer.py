"""The reference models, built for one pipeline stage (layers [l0, l1)) and one TP rank.

Family `gpt`: token embedding + learned position embedding, pre-LN blocks (causal attention
with `heads` query and `kv_heads` key/value heads; MLP with GELU, or SwiGLU when `gated_mlp`),
final LN and an output head. Family `llama` (Llama, Mistral, Qwen2 as transformers computes
them): token embedding, pre-RMSNorm blocks with rotary embeddings (HF's rotate-half form,
`rope_theta`, `rope_scaling` linear or llama3), grouped-query attention and a SwiGLU MLP, no
biases but q/k/v's when `qkv_bias` and the attention output's when `o_bias`, final RMSNorm and
the head. `tie_embeddings`: the head is the embedding's matrix (one parameter when one stage
holds both; with pipeline stages the last stage holds a copy whose gradient the trainer sums
with the embedding's, as Megatron does).
Attention and MLP matrices are Megatron-split over the TP group
(q/k/v and the MLP's first matrices by columns, the attention output and the MLP's last matrix
by rows); embeddings, norms and the head are replicated on every TP rank.

Every parameter is initialised from (seed, full parameter name) on the FULL tensor and then
sliced for the TP rank, so any plan (and the single-process run) starts from identical weights.
Parameter names are those of the full model (`layers.7.attn.q.weight`), whatever the stage.
"""

from __future__ import annotations

import math
import zlib
from typing import Dict, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from ..spec import ModelSpec, PlanError
from .tp import ColumnParallelLinear, RowParallelLinear


def param_generator(seed: int, name: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**62))
    return g


def full_init(seed: int, name: str, shape: Tuple[int, ...], kind: str, std: float) -> torch.Tensor:
    """The full (unsharded) initial value of a parameter, in fp32 on the CPU."""
    if kind == "ones":
        return torch.ones(shape)
    if kind == "zeros":
        return torch.zeros(shape)
    return torch.randn(shape, generator=param_generator(seed, name)) * std


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: normalised in fp32, scaled in the input's type."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(m: ModelSpec) -> torch.Tensor:
    """transformers' inverse frequencies for rope types default, linear and llama3."""
    dim = m.hidden // m.heads
    # On the CPU whatever device the model is being built on (meta, for --init-from-hf).
    inv = 1.0 / (m.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    rs = m.rope_scaling
    if rs is None:
        return inv
    if rs["type"] == "linear":
        return inv / rs["factor"]
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    low_wl, high_wl = old / lo, old / hi
    wl = 2 * math.pi / inv
    out = torch.where(wl > low_wl, inv / factor, inv)
    smooth = (old / wl - lo) / (hi - lo)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wl < high_wl) * ~(wl > low_wl)
    return torch.where(medium, smoothed, out)


class Rotary(nn.Module):
    """cos/sin of every position (computed in fp32, cast to the activations' type, as
    transformers does), cached per (length, device, dtype)."""

    def __init__(self, m: ModelSpec):
        super().__init__()
        self.inv = rope_inv_freq(m)
        self.cache: Dict[tuple, Tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, s: int, device, dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():
            # Inside a compiled block the few flops are fused into the block's kernels; a
            # Python cache would only break the graph.
            return self._compute(s, device, dtype)
        key = (s, str(device), dtype)
        if key not in self.cache:
            self.cache = {key: self._compute(s, device, dtype)}
        return self.cache[key]

    def _compute(self, s: int, device, dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(s, dtype=torch.float32, device=device)
        freqs = torch.outer(pos, self.inv.to(device))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Block(nn.Module):
    def __init__(self, m: ModelSpec, group, tp_rank: int, tp_size: int):
        super().__init__()
        for what, n in (("heads", m.heads), ("kv_heads", m.kv_heads), ("ffn_hidden", m.ffn_hidden)):
            if n % tp_size:
                raise PlanError(f"model.{what}: {n} is not divisible by the plan's tp {tp_size}; use a tp that divides it")
        h, hd = m.hidden, m.hidden // m.heads
        self.hd = hd
        self.local_heads = m.heads // tp_size
        self.local_kv = m.kv_heads // tp_size
        self.tp_size, self.group = tp_size, group
        kw = dict(group=group, tp_rank=tp_rank, tp_size=tp_size)
        self.llama = m.family == "llama"
        norm = (lambda: RMSNorm(h, m.norm_eps)) if self.llama else (lambda: nn.LayerNorm(h))
        qkv_bias = m.qkv_bias if self.llama else True
        self.ln1 = norm()
        self.attn = nn.Module()
        self.attn.q = ColumnParallelLinear(h, m.heads * hd, bias=qkv_bias, **kw)
        self.attn.k = ColumnParallelLinear(h, m.kv_heads * hd, bias=qkv_bias, **kw)
        self.attn.v = ColumnParallelLinear(h, m.kv_heads * hd, bias=qkv_bias, **kw)
        # Row-parallel: its bias is added once, after the partial sums' all-reduce (tp.py).
        self.attn.o = RowParallelLinear(m.heads * hd, h, bias=m.o_bias if self.llama else True, **kw)
        if self.llama:
            self.rotary = Rotary(m)
        self.ln2 = norm()
        self.mlp = nn.Module()
        self.gated = m.gated_mlp
        if m.gated_mlp:
            self.mlp.gate = ColumnParallelLinear(h, m.ffn_hidden, bias=False, **kw)
            self.mlp.up = ColumnParallelLinear(h, m.ffn_hidden, bias=False, **kw)
            self.mlp.down = RowParallelLinear(m.ffn_hidden, h, bias=False, **kw)
        else:
            self.mlp.fc1 = ColumnParallelLinear(h, m.ffn_hidden, **kw)
            self.mlp.fc2 = RowParallelLinear(m.ffn_hidden, h, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.ln1(x)
        q = self.attn.q(y).view(b, s, self.local_heads, self.hd).transpose(1, 2)
        k = self.attn.k(y).view(b, s, self.local_kv, self.hd).transpose(1, 2)
        v = self.attn.v(y).view(b, s, self.local_kv, self.hd).transpose(1, 2)
        if self.local_kv != self.local_heads:
            rep = self.local_heads // self.local_kv
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if self.llama:
            cos, sin = self.rotary(s, x.device, q.dtype)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            a = att @ v
        a = a.transpose(1, 2).reshape(b, s, self.local_heads * self.hd)
        x = x + self.attn.o(a)
        y = self.ln2(x)
        if self.gated:
            y = self.mlp.down(F.silu(self.mlp.gate(y)) * self.mlp.up(y))
        else:
            y = self.mlp.fc2(F.gelu(self.mlp.fc1(y)))
        return x + y


class GPTStage(nn.Module):
    """Layers [l0, l1) of the GPT; the embeddings on the first stage, the head on the last."""

    def __init__(self, m: ModelSpec, seq_len: int, layers: Tuple[int, int], group=None,
                 tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.spec, self.seq_len, self.l0, self.l1 = m, seq_len, layers[0], layers[1]
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.recompute = False
        self.compiled = False
        self.first = self.l0 == 0
        self.last = self.l1 == m.layers
        self.llama = m.family == "llama"
        if self.llama:
            m.check_seq_len(seq_len)
        if self.first:
            self.embed = nn.Embedding(m.vocab, m.hidden)
            if not self.llama:
                self.pos = nn.Embedding(seq_len, m.hidden)
        self.layers = nn.ModuleDict({str(i): Block(m, group, tp_rank, tp_size) for i in range(self.l0, self.l1)})
        # A tied head on the embedding's stage is the embedding; on another stage, a copy.
        self.tied_here = m.tie_embeddings and self.first and self.last
        if self.last:
            self.ln_f = RMSNorm(m.hidden, m.norm_eps) if self.llama else nn.LayerNorm(m.hidden)
            if not self.tied_here:
                self.head = nn.Linear(m.hidden, m.vocab, bias=False)

    def compile_blocks(self, mode: Optional[str] = None):
        """torch.compile each block in place (names and parameters unchanged), as torchtitan
        does per block: a stage's blocks share one shape, so they compile once and the
        elementwise work (norms, rotary, SwiGLU, residual adds) fuses around the matmuls.
        `mode="reduce-overhead"` also captures them with CUDA graphs."""
        for blk in self.layers.values():
            blk.compile(mode=mode, dynamic=False)
        self.compiled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens [b, s] on the first stage, hidden states [b, s, hidden] after; logits
        [b, s, vocab] out of the last stage, hidden states out of the others."""
        x = self._body(x)
        if self.last:
            x = F.linear(x, self.head_weight())
        return x

    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.tied_here else self.head.weight

    def loss(self, x: torch.Tensor, targets: torch.Tensor, grad_scale: float = 1.0) -> torch.Tensor:
        """The last stage: the summed token cross-entropy (fp32) of its input, without ever
        holding the micro-batch's full logits (head_loss.linear_cross_entropy; `grad_scale`:
        the gradient its backward will bring)."""
        from .head_loss import linear_cross_entropy

        return linear_cross_entropy(self._body(x), self.head_weight(), targets, compiled=self.compiled,
                                    grad_scale=grad_scale)

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        """Embeddings (first stage), the blocks, the final norm (last stage)."""
        if self.first:
            s = x.shape[1]
            x = self.embed(x)
            if not self.llama:
                x = x + self.pos(torch.arange(s, device=x.device))[None]
        for blk in self.layers.values():
            if self.recompute and torch.is_grad_enabled():
                # Full activation recomputation (the plan's `recompute`): only the block's input
                # is kept; its forward runs again in the backward pass.
                x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        if self.last:
            x = self.ln_f(x)
        return x

    def tied_weights(self) -> list:
        """The parameters that are the tied embedding/head matrix on this stage (empty when the
        model is untied or the stage holds neither)."""
        if not self.spec.tie_embeddings:
            return []
        out = []
        if self.first:
            out.append(self.embed.weight)
        if self.last and not self.tied_here:
            out.append(self.head.weight)
        return out

    # -- parameters by their full-model names ----------------------------------------------

    def full_params(self) -> Iterator[Tuple[str, nn.Parameter, Optional[nn.Module], str]]:
        """(full name, local parameter, the TP layer that shards it or None, 'weight'|'bias')."""
        for name, p in self.named_parameters():
            mod_name, _, attr = name.rpartition(".")
            mod = self.get_submodule(mod_name)
            tp_mod = mod if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)) else None
            yield name, p, tp_mod, attr

    def full_shape(self, name: str, p: torch.Tensor, tp_mod) -> Tuple[int, ...]:
        if tp_mod is None:
            return tuple(p.shape)
        if isinstance(tp_mod, ColumnParallelLinear):
            return (tp_mod.out_features,) + tuple(p.shape[1:])
        return (tp_mod.out_features, tp_mod.in_features) if p.dim() == 2 else tuple(p.shape)

    def init_kind(self, name: str, attr: str) -> Tuple[str, float]:
        """Layer norms start at (1, 0), biases at 0; matrices and embeddings N(0, 0.02), the
        matrices writing into the residual stream N(0, 0.02 / sqrt(2 * layers)) (GPT-2)."""
        mod = self.get_submodule(name.rpartition(".")[0])
        if isinstance(mod, (nn.LayerNorm, RMSNorm)):
            return ("ones", 0.0) if attr == "weight" else ("zeros", 0.0)
        if attr == "bias":
            return "zeros", 0.0
        if isinstance(mod, RowParallelLinear) and not self.llama:
            return "normal", 0.02 / math.sqrt(2 * self.spec.layers)
        return "normal", 0.02

    def init_from_seed(self, seed: int):
        with torch.no_grad():
            for name, p, tp_mod, attr in self.full_params():
                kind, std = self.init_kind(name, attr)
                # A tied head's copy starts as the embedding it is.
                key = "embed.weight" if name == "head.weight" and self.spec.tie_embeddings else name
                full = full_init(seed, key, self.full_shape(name, p, tp_mod), kind, std)
                part = tp_mod.shard(full, attr) if tp_mod is not None else full
                p.copy_(part.to(dtype=p.dtype, device=p.device))

    def load_full_state(self, tensors: Dict[str, torch.Tensor]):
        with torch.no_grad():
            for name, p, tp_mod, attr in self.full_params():
                full = tensors[name]
                part = tp_mod.shard(full, attr) if tp_mod is not None else full
                p.copy_(part.to(dtype=p.dtype, device=p.device))

    def load_hf(self, directory: str):
        """This stage's parameters, at this TP rank, from a Hugging Face safetensors checkpoint
        (`model.safetensors` or the index and its shards): each rank reads only its layers'
        tensors and, of those, only its rows (column-split) or columns (row-split), so no
        process holds the whole model (hf.read_rank_into). First, before any byte is read: every
        tensor of its layers and ends in the checkpoint is one it uses (hf.check_all_used)."""
        from .hf import check_all_used, read_rank_into

        names = [name for name, *_ in self.full_params()]
        check_all_used(directory, self.spec, names, range(self.l0, self.l1), self.first, self.last)
        wanted, staged = [], []
        for name, p, tp_mod, attr in self.full_params():
            full = self.full_shape(name, p, tp_mod)
            part = None
            if isinstance(tp_mod, ColumnParallelLinear):
                n = tp_mod.out_features // self.tp_size
                part = (0, self.tp_rank * n, (self.tp_rank + 1) * n)
            elif isinstance(tp_mod, RowParallelLinear) and attr == "weight":
                n = tp_mod.in_features // self.tp_size
                part = (1, self.tp_rank * n, (self.tp_rank + 1) * n)
            if p.device.type == "cpu":
                wanted.append((name, full, part, p.data))
            else:
                staged.append((name, full, part, p))
        read_rank_into(directory, self.spec, wanted)
        # Parameters on a GPU: one tensor at a time through host memory.
        for name, full, part, p in staged:
            host = torch.empty(p.shape, dtype=p.dtype)
            read_rank_into(directory, self.spec, [(name, full, part, host)])
            with torch.no_grad():
                p.copy_(host)
            del host

    def gather_full(self, tp_group, grads: bool = False,
                    values: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
        """Full (unsharded) fp32 CPU tensors of this stage's parameters (or their gradients):
        TP shards are all-gathered over `tp_group` (every TP rank of the stage must call this).
        `values`: this rank's shard of each parameter to use instead of the parameter (ZeRO-1's
        fp32 masters, `zero.ZeroOne.export_masters`)."""
        import torch.distributed as dist

        out = {}
        for name, p, tp_mod, attr in self.full_params():
            if values is not None:
                t = values[name].to(p.device)
            else:
                t = p.detach() if not grads else (p.grad.detach() if p.grad is not None else torch.zeros_like(p))
            if tp_mod is not None and self.tp_size > 1 and not (isinstance(tp_mod, RowParallelLinear) and attr == "bias"):
                parts = [torch.empty_like(t) for _ in range(self.tp_size)]
                dist.all_gather(parts, t.contiguous(), group=tp_group)
                t = torch.cat(parts, dim=0 if isinstance(tp_mod, ColumnParallelLinear) else 1)
            out[name] = t.float().cpu().contiguous()
        return out

    def segment_of(self, name: str) -> int:
        """The layer a parameter belongs to for gradient rings: its block's layer; the
        embeddings go with layer 0, the final LN and head with the last layer."""
        if name.startswith("layers."):
            return int(name.split(".")[1])
        if name.startswith(("embed.", "pos.")):
            return 0
        return self.spec.layers - 1
