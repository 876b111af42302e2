"""The llama family equals transformers in fp32 (logits, loss and gradients, each within the
rounding its chain of operations explains: tolerance.py), for Llama (rope_theta and llama3 /
linear scaling, GQA, tied and untied heads, attention_bias: q/k/v and o biases), Qwen2 (q/k/v
biases) and Mistral, and a real error (a wrong rope_theta, norm epsilon or weight, a dropped
bias) fails that margin; Hugging Face configs in both spellings; weights in (lazy per-rank
slices, sharded indexes, every tensor of the checkpoint used or the load refused) and out
(--save-hf, loaded back by transformers); bad input named."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from hf_models import add_tokenizer, load_hf, make_hf  # noqa: E402
from launcher import PYTHON, python_env  # noqa: E402
from tolerance import assert_close_rel, excess, forward_ops, gradient_ops, loss_ops  # noqa: E402

from motley_torch.models.hf import HFError, spec_from_config, write_hf  # noqa: E402
from motley_torch.models.transformer import GPTStage  # noqa: E402
from motley_torch.model_source import load_model  # noqa: E402
from motley_torch.spec import ModelSpec, PlanError  # noqa: E402

SEQ = 24

VARIANTS = {
    "llama-gqa": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    # transformers' LlamaAttention: q_proj, k_proj, v_proj and o_proj all take
    # bias=config.attention_bias (modeling_llama.py).
    "llama-attention-bias": ("llama", {"attention_bias": True}),
    "llama3-scaling": ("llama", {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}),
    "linear-scaling": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "qwen2-bias": ("qwen2", {}),
    "mistral": ("mistral", {"sliding_window": None}),
}


class Outputs:
    """transformers' and Motley's logits, losses and gradients (by HF name) on one batch."""

    def __init__(self, hf_dir, spec=None, tamper=None):
        from motley_torch.models.hf import hf_name

        ref = load_hf(hf_dir)
        spec = spec or load_model(str(hf_dir))
        ours = GPTStage(spec, SEQ, (0, spec.layers))
        ours.load_hf(str(hf_dir))
        if tamper is not None:
            with torch.no_grad():
                tamper(dict(ours.named_parameters()))
        g = torch.Generator().manual_seed(3)
        x = torch.randint(0, spec.vocab, (3, SEQ + 1), generator=g)
        self.theirs, self.ours = ref(x[:, :-1]).logits, ours(x[:, :-1])
        la = F.cross_entropy(self.theirs.reshape(-1, spec.vocab), x[:, 1:].reshape(-1))
        lb = F.cross_entropy(self.ours.reshape(-1, spec.vocab), x[:, 1:].reshape(-1))
        la.backward()
        lb.backward()
        self.loss_theirs, self.loss_ours = la.item(), lb.item()
        theirs = dict(ref.named_parameters())
        self.grads = [(n, p.grad, theirs[hf_name(n, spec)].grad) for n, p in ours.named_parameters()]
        self.layers = spec.layers

    def logits_excess(self) -> float:
        return excess(self.ours, self.theirs, forward_ops(self.layers))

    def worst_gradient_excess(self) -> float:
        return max(excess(a, b, gradient_ops(self.layers)) for _, a, b in self.grads)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_loss_and_gradients_equal_transformers(tmp_path, variant):
    kind, over = VARIANTS[variant]
    out = Outputs(make_hf(tmp_path / variant, kind, **over))
    assert out.theirs.abs().max().item() > 1.0, "the logits are not trivially small"
    assert_close_rel(out.ours, out.theirs, forward_ops(out.layers), f"{variant}: logits")
    assert_close_rel(out.loss_ours, out.loss_theirs, loss_ops(out.layers), f"{variant}: loss")
    for name, a, b in out.grads:
        assert_close_rel(a, b, gradient_ops(out.layers), f"{variant}: gradient of {name}")


def _perturb_one_matrix(params):
    """One weight matrix off by 1e-4 of itself, at random: a weight read with a wrong
    conversion, or a layer's slice shifted by a rounding step of bf16."""
    w = params["layers.1.mlp.down.weight"]
    w.mul_(1.0 + 1e-4 * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))


def _drop_biases(params):
    """Every bias zeroed: what a model computes when it leaves its checkpoint's biases out (a
    spec without them is no longer a way to get there: the load refuses the biases unused)."""
    for name, p in params.items():
        if name.endswith(".bias"):
            p.zero_()


def _respec(**change):
    return lambda spec: ModelSpec.from_dict(dict(spec.to_dict(), **change))


# Each a real error the comparison must catch, with how far past the margin it lands today
# (logits; tolerance.py's bound = 1): rope_theta 500 for 10000 (about 2e5 times), rope_theta off
# by 0.1% (about 120 times), RMSNorm's epsilon read as transformers' default 1e-6 instead of the
# config's 1e-5 (about 70 times), the q/k/v biases dropped (about 2e5 times), one matrix off by
# 1e-4 of itself (about 18 times). Asserted with a factor 4 to spare.
REAL_ERRORS = {
    "rope_theta 500": ("llama", _respec(rope_theta=500.0), None),
    "rope_theta off by 0.1%": ("llama", _respec(rope_theta=10010.0), None),
    "norm eps 1e-6 for 1e-5": ("llama", _respec(norm_eps=1e-6), None),
    "q/k/v biases dropped": ("qwen2", None, _drop_biases),
    "one matrix off by 1e-4": ("llama", None, _perturb_one_matrix),
}


@pytest.mark.parametrize("error", sorted(REAL_ERRORS))
def test_a_real_error_fails_the_margin(tmp_path, error):
    """The margins above are loose enough for rounding and no looser: the same weights under a
    wrong setting, or with one matrix slightly off, fail them clearly."""
    kind, respec, tamper = REAL_ERRORS[error]
    d = make_hf(tmp_path / "m", kind)
    spec = respec(load_model(str(d))) if respec else None
    out = Outputs(d, spec, tamper)
    assert out.logits_excess() > 4.0, (error, out.logits_excess())
    assert out.worst_gradient_excess() > 4.0, (error, out.worst_gradient_excess())
    with pytest.raises(AssertionError, match="over the bound"):
        assert_close_rel(out.ours, out.theirs, forward_ops(out.layers), f"{error}: logits")


def test_tp_slices_read_per_rank_equal_the_full_tensors(tmp_path):
    """Each TP rank reads only its rows (column-split) or columns (row-split) of a sharded
    checkpoint (index + 3 shard files); concatenated they are the full tensors."""
    d = make_hf(tmp_path / "m", "qwen2", max_shard_size="40KB")
    assert (d / "model.safetensors.index.json").exists()
    spec = load_model(str(d))
    full = GPTStage(spec, SEQ, (0, spec.layers))
    full.load_hf(str(d))
    want = dict(full.named_parameters())
    for tp in (2, 4):
        parts = []
        for r in range(tp):
            m = GPTStage(spec, SEQ, (1, 3), tp_rank=r, tp_size=tp)
            m.load_hf(str(d))
            parts.append(dict(m.named_parameters()))
        for name in parts[0]:
            if ".attn.o." in name or ".mlp.down." in name:
                got = torch.cat([p[name] for p in parts], dim=1)
            elif ".attn." in name or ".mlp." in name:
                got = torch.cat([p[name] for p in parts], dim=0)
            else:
                got = parts[0][name]
            assert torch.equal(got, want[name]), (tp, name)


def base_config(**over):
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 8,
           "num_key_value_heads": 4, "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 96,
           "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu"}
    cfg.update(over)
    return cfg


def test_both_config_spellings_give_one_spec():
    old = spec_from_config(base_config(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0}), "m", "c")
    new = spec_from_config(base_config(rope_theta=None, rope_parameters={
        "rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}), "m", "c")
    assert old == new
    assert old.rope_theta == 5e5 and old.rope_scaling == {"type": "linear", "factor": 2.0}
    assert old.family == "llama" and old.gated_mlp and old.kv_heads == 4 and old.norm_eps == 1e-6
    q = spec_from_config(base_config(architectures=["Qwen2ForCausalLM"], use_sliding_window=False,
                                     sliding_window=16), "q", "c")
    assert q.qkv_bias and not q.o_bias and q.sliding_window is None
    biased = spec_from_config(base_config(attention_bias=True), "b", "c")
    assert biased.qkv_bias and biased.o_bias, "Llama's attention_bias biases q, k, v and o"
    assert not old.qkv_bias and not old.o_bias
    # Mistral's attention has no biases whatever the config says (modeling_mistral.py).
    m = spec_from_config(base_config(architectures=["MistralForCausalLM"], attention_bias=True), "m", "c")
    assert not m.qkv_bias and not m.o_bias


@pytest.mark.parametrize("over,needle", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures: ['GPT2LMHeadModel'] is not supported; Motley trains "
                                             "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"),
    ({"architectures": None}, "architectures: None is not supported"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"head_dim": 16}, "head_dim"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type: 'yarn' is not supported"),
    ({"num_key_value_heads": 3}, "kv_heads: 3 does not divide heads 8"),
])
def test_unsupported_configs_are_named(over, needle):
    with pytest.raises(PlanError) as e:
        spec_from_config(base_config(**over), "m", "/x/config.json")
    assert needle in str(e.value) and str(e.value).startswith("/x/config.json"), str(e.value)


def test_a_sliding_window_under_the_sequence_length_is_refused():
    spec = spec_from_config(base_config(architectures=["MistralForCausalLM"], sliding_window=32), "m", "c")
    assert spec.seq_len == 32, "the default sequence length fits the window"
    GPTStage(spec, 32, (0, 1))
    with pytest.raises(PlanError, match="model.sliding_window: 32 is under the sequence length 64"):
        GPTStage(spec, 64, (0, 1))


def test_a_tp_degree_that_does_not_divide_kv_heads_is_refused():
    spec = spec_from_config(base_config(num_key_value_heads=2), "m", "c")
    with pytest.raises(PlanError, match="model.kv_heads: 2 is not divisible by the plan's tp 4; use a tp that divides it"):
        GPTStage(spec, 8, (0, 1), tp_rank=0, tp_size=4)


def test_weights_missing_or_misshapen_are_named(tmp_path):
    d = make_hf(tmp_path / "m", "llama", max_shard_size="40KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (d / shard).unlink()
    spec = load_model(str(d))
    with pytest.raises(HFError, match=f"shard {shard} is missing"):
        GPTStage(spec, 8, (0, spec.layers)).load_hf(str(d))
    wrong = ModelSpec.from_dict(dict(spec.to_dict(), vocab=100))
    e = make_hf(tmp_path / "n", "llama")
    with pytest.raises(HFError, match=r"model.embed_tokens.weight has shape \[96, 64\], the model spec needs \[100, 64\]"):
        GPTStage(wrong, 8, (0, 1)).load_hf(str(e))


def _add_tensors(path, extra):
    """Rewrite the safetensors file `path` with the tensors `extra` (name -> tensor) added."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    tensors.update(extra)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_a_tensor_the_model_does_not_use_is_refused_naming_it(tmp_path):
    """Every tensor of the checkpoint is read, or the load is refused naming the ones left: a
    tensor dropped silently trains another model than the weights'. Each rank answers for the
    tensors of its own layers and ends, and every rank for those of no layer of the model."""
    d = make_hf(tmp_path / "m", "llama")
    spec = load_model(str(d))
    _add_tensors(d / "model.safetensors", {"model.layers.3.mlp.down_proj.bias": torch.ones(64),
                                           "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)})
    want = (r"the weights hold 1 tensor the model does not use: model\.layers\.3\.mlp\.down_proj\.bias; "
            r"config\.json does not describe these weights")
    with pytest.raises(HFError, match=want):
        GPTStage(spec, 8, (0, spec.layers)).load_hf(str(d))
    with pytest.raises(HFError, match=want):
        GPTStage(spec, 8, (2, 4)).load_hf(str(d))
    # Layers 0 and 1 use every tensor of theirs (a rotary inv_freq buffer is no weight).
    GPTStage(spec, 8, (0, 2), tp_rank=1, tp_size=2).load_hf(str(d))

    # A layer the model does not have is every rank's to refuse; so is a head beside a tied one.
    t = make_hf(tmp_path / "t", "llama", tie_word_embeddings=True)
    tied = load_model(str(t))
    _add_tensors(t / "model.safetensors", {"model.layers.9.mlp.up_proj.weight": torch.ones(2, 2),
                                           "lm_head.weight": torch.ones(96, 64)})
    with pytest.raises(HFError, match=r"the weights hold 1 tensor the model does not use: "
                                      r"model\.layers\.9\.mlp\.up_proj\.weight;"):
        GPTStage(tied, 8, (0, 1)).load_hf(str(t))
    with pytest.raises(HFError, match=r"2 tensors the model does not use: lm_head\.weight, "
                                      r"model\.layers\.9\.mlp\.up_proj\.weight;"):
        GPTStage(tied, 8, (3, 4)).load_hf(str(t))
    # A head equal to the embedding is the tied head transformers reads too (it unties unequal
    # ones).
    u = make_hf(tmp_path / "u", "llama", tie_word_embeddings=True)
    from safetensors.torch import load_file

    _add_tensors(u / "model.safetensors", {"lm_head.weight": load_file(str(u / "model.safetensors"))[
        "model.embed_tokens.weight"].clone()})
    GPTStage(tied, 8, (3, 4)).load_hf(str(u))

    # Llama weights with attention biases under a config that declares none: the biases named,
    # and the fix. Also in a shard the index does not list, which transformers would load.
    b = make_hf(tmp_path / "b", "llama", attention_bias=True, max_shard_size="40KB")
    cfg = json.loads((b / "config.json").read_text())
    (b / "config.json").write_text(json.dumps(dict(cfg, attention_bias=False)))
    with pytest.raises(HFError) as e:
        GPTStage(load_model(str(b)), 8, (0, 1)).load_hf(str(b))
    msg = str(e.value)
    assert msg.startswith(f"{b}: the weights hold 4 tensors the model does not use: "
                          f"model.layers.0.self_attn.k_proj.bias, model.layers.0.self_attn.o_proj.bias, "
                          f"model.layers.0.self_attn.q_proj.bias, model.layers.0.self_attn.v_proj.bias; "), msg
    assert "attention_bias" in msg, msg
    (b / "config.json").write_text(json.dumps(cfg))
    index = json.loads((b / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    _add_tensors(b / shard, {"model.layers.1.mlp.up_proj.bias": torch.ones(96)})
    with pytest.raises(HFError, match=r"the weights hold 1 tensor the model does not use: "
                                      r"model\.layers\.1\.mlp\.up_proj\.bias;"):
        GPTStage(load_model(str(b)), 8, (1, 2)).load_hf(str(b))
    GPTStage(load_model(str(b)), 8, (0, 1)).load_hf(str(b))


def test_trainer_init_from_hf_then_save_hf_loads_in_transformers(tmp_path):
    """--init-from-hf starts from the weights (step 0's loss is transformers' on that batch),
    --save-hf writes what transformers loads, with the trained model's logits, and the source's
    tokenizer and generation config; a second run into the same directory is refused unless
    --replace."""
    import transformers as tf

    from motley_torch.components.data import global_batch_tokens

    d = add_tokenizer(make_hf(tmp_path / "m", "llama", tie_word_embeddings=True))
    out = tmp_path / "out"

    def train(steps: int, *extra: str):
        cmd = [PYTHON, "-m", "motley_torch.train", "--single-process", "--init-from-hf", str(d), "--global-batch", "4",
               "--seq-len", "16", "--steps", str(steps), "--seed", "5", "--save-hf", str(out), *extra]
        return subprocess.run(cmd, capture_output=True, text=True, env=python_env(OMP_NUM_THREADS="1"), timeout=300)

    r = train(3, "--save-params", str(tmp_path / "p"))
    assert r.returncode == 0, r.stderr
    lines = [d for d in map(json.loads, r.stdout.splitlines()) if "loss" in d]
    assert [x["step"] for x in lines] == [0, 1, 2]
    assert all(x["tokens_per_s"] > 0 and x["step_s"] > 0 for x in lines)
    ref, spec = load_hf(d), load_model(str(d))
    tokens = global_batch_tokens(5, 0, 4, 16, 96)
    want = F.cross_entropy(ref(tokens[:, :-1]).logits.reshape(-1, 96), tokens[:, 1:].reshape(-1)).item()
    assert_close_rel(lines[0]["loss"], want, loss_ops(spec.layers), "step 0's loss against transformers'")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["architectures"] == ["LlamaForCausalLM"]
    trained = load_hf(out)
    from safetensors.torch import load_file

    ours = GPTStage(spec, 16, (0, spec.layers))
    ours.load_full_state(load_file(str(tmp_path / "p" / "params.safetensors")))
    after = trained(tokens[:, :-1]).logits
    assert_close_rel(ours(tokens[:, :-1]), after, forward_ops(spec.layers), "the --save-hf model's logits in transformers")
    assert excess(after, ref(tokens[:, :-1]).logits, forward_ops(spec.layers)) > 100, "it trained"
    # A whole Hugging Face directory: the tokenizer and the generation defaults came along.
    text = "w5 w17 w3 w95"
    assert tf.AutoTokenizer.from_pretrained(str(out))(text)["input_ids"] == \
        tf.AutoTokenizer.from_pretrained(str(d))(text)["input_ids"] == [5, 17, 3, 95]
    assert json.loads((out / "generation_config.json").read_text()) == \
        json.loads((d / "generation_config.json").read_text())
    assert f"--save-hf: wrote {out}; tokenizer.json, tokenizer_config.json, generation_config.json from {d}" in r.stderr

    # Into the same directory again: refused before training, naming the option to replace it.
    again = train(3)
    assert again.returncode == 2 and not again.stdout, again.stderr
    assert again.stderr.strip().splitlines()[-1].startswith(f"motley_torch.train: --save-hf: {out} is not empty (it "
                                                            f"holds config.json, generation_config.json, model.safetensors"
                                                            f" and 2 more); give a new or empty directory, or pass "
                                                            f"--replace"), again.stderr
    before = sorted(p.name for p in out.iterdir())
    (out / "stale.bin").write_bytes(b"x")
    replaced = train(1, "--replace")
    assert replaced.returncode == 0, replaced.stderr
    assert sorted(p.name for p in out.iterdir()) == before, "the old files are replaced, the stale one gone"


def test_an_attention_bias_llama_trains_and_saves_as_llama(tmp_path):
    """--init-from-hf of a Llama with attention_bias starts from all its biases (o_proj's too:
    step 0's loss is transformers'), trains them, and --save-hf writes a LlamaForCausalLM with
    attention_bias true whose logits in transformers are the trained model's."""
    from safetensors.torch import load_file

    from motley_torch.components.data import global_batch_tokens

    kind, over = VARIANTS["llama-attention-bias"]
    d = make_hf(tmp_path / "m", kind, **over)
    out, params = tmp_path / "out", tmp_path / "p"
    cmd = [PYTHON, "-m", "motley_torch.train", "--single-process", "--init-from-hf", str(d), "--global-batch", "4",
           "--seq-len", "16", "--steps", "2", "--seed", "5", "--save-hf", str(out), "--save-params", str(params)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=python_env(OMP_NUM_THREADS="1"), timeout=300)
    assert r.returncode == 0, r.stderr
    first = next(x for x in map(json.loads, r.stdout.splitlines()) if x.get("step") == 0 and "loss" in x)
    ref, spec = load_hf(d), load_model(str(d))
    tokens = global_batch_tokens(5, 0, 4, 16, spec.vocab)
    want = F.cross_entropy(ref(tokens[:, :-1]).logits.reshape(-1, spec.vocab), tokens[:, 1:].reshape(-1)).item()
    assert_close_rel(first["loss"], want, loss_ops(spec.layers), "step 0's loss against transformers'")
    assert spec.o_bias
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["architectures"], cfg["model_type"], cfg["attention_bias"]) == (["LlamaForCausalLM"], "llama", True)
    trained = load_hf(out)
    bias = "model.layers.0.self_attn.o_proj.bias"
    assert not torch.equal(trained.get_parameter(bias), ref.get_parameter(bias)), "the o bias trained"
    ours = GPTStage(spec, 16, (0, spec.layers))
    ours.load_full_state(load_file(str(params / "params.safetensors")))
    assert_close_rel(ours(tokens[:, :-1]), trained(tokens[:, :-1]).logits, forward_ops(spec.layers),
                     "the --save-hf model's logits in transformers")


@pytest.mark.parametrize("variant,arch", [("qwen2-bias", "Qwen2ForCausalLM"),
                                          ("llama-attention-bias", "LlamaForCausalLM")])
def test_write_hf_cuts_shards_and_writes_the_index(tmp_path, variant, arch):
    """Written back, the weights load in transformers as the architecture they came from (Llama's
    attention_bias biases o as well as q/k/v: never Qwen2's config, which has no o bias)."""
    kind, over = VARIANTS[variant]
    d = make_hf(tmp_path / "m", kind, **over)
    spec = load_model(str(d))
    m = GPTStage(spec, 8, (0, spec.layers))
    m.load_hf(str(d))
    state = m.state_dict()
    from motley_torch.models.hf import motley_order

    names = write_hf(str(tmp_path / "o"), spec, ((n, state[n]) for n in motley_order(spec)), max_shard_bytes=60_000)
    assert len(names) > 2 and names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    index = json.loads((tmp_path / "o" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(names)
    for n in names:
        assert (tmp_path / "o" / n).stat().st_size <= 60_000 + 10_000
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert cfg["architectures"] == [arch]
    assert cfg.get("attention_bias", False) is (arch == "LlamaForCausalLM"), cfg
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        assert set(index["weight_map"]) == set(f.keys()), "every tensor written back, under its own name"
    back = load_hf(tmp_path / "o")
    x = torch.randint(0, 96, (2, 8))
    # The same fp32 values through the same transformers code: equal to the bit.
    assert torch.equal(back(x).logits, load_hf(d)(x).logits)


def test_the_trainer_refuses_bad_hf_input_with_exit_2(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    cmd = [PYTHON, "-m", "motley_torch.train", "--single-process", "--init-from-hf", str(d), "--global-batch", "2",
           "--steps", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=python_env(), timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith(f"motley_torch.train: {d}/config.json: architectures"), r.stderr


@pytest.mark.parametrize("variant", ["llama3-scaling", "qwen2-bias", "llama-tied", "llama-attention-bias"])
def test_the_rank_library_and_motley_read_a_config_alike(tmp_path, variant):
    """config.json is mapped twice (the rank library reads it without the motley binary, which
    ranks may not have; the planner in Rust): both give the same spec."""
    from launcher import motley_bin

    b = motley_bin()
    assert b is not None, "no motley binary: python/run-tests sets MOTLEY_BIN"
    kind, over = VARIANTS[variant]
    d = make_hf(tmp_path / variant, kind, **over)
    r = subprocess.run([b, "model", "show", str(d), "-o", "json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == load_model(str(d)).to_dict()
