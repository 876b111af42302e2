"""The training sequence length: a Hugging Face model's is the stated default (the smaller of its
max_position_embeddings and 4096), read alike by the rank library and the planner, and exported
back as the model's maximum; under a plan the trainer refuses a --seq-len or --global-batch that
contradicts it, naming both."""

import json
import subprocess

import pytest

from launcher import PYTHON, hand_plan, motley_bin, python_env
from motley_torch.models.hf import DEFAULT_SEQ_LEN, config_from_spec, spec_from_config
from motley_torch.spec import ModelSpec, PlanError

LLAMA31 = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 96,
           "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}}


def test_a_hugging_face_model_trains_at_the_default_not_its_maximum():
    spec = spec_from_config(LLAMA31, "m", "c")
    assert (spec.seq_len, spec.max_position_embeddings, DEFAULT_SEQ_LEN) == (4096, 131072, 4096)
    short = spec_from_config(dict(LLAMA31, max_position_embeddings=512), "m", "c")
    assert (short.seq_len, short.max_position_embeddings) == (512, 512)
    # Exported, the model keeps its maximum, not the length it was trained at.
    assert config_from_spec(spec)["max_position_embeddings"] == 131072
    # A model file without one exports its seq_len, as before.
    plain = ModelSpec.from_dict(dict(name="p", family="llama", layers=2, hidden=64, heads=4, seq_len=64, vocab=96,
                                     gated_mlp=True))
    assert plain.max_position_embeddings is None and config_from_spec(plain)["max_position_embeddings"] == 64
    with pytest.raises(PlanError, match="seq_len: 1024 is more than max_position_embeddings 512"):
        ModelSpec.from_dict(dict(spec.to_dict(), seq_len=1024, max_position_embeddings=512))


def test_the_planner_states_the_same_default(tmp_path):
    b = motley_bin()
    assert b is not None, "no motley binary: python/run-tests sets MOTLEY_BIN"
    d = tmp_path / "Llama-3.1"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA31))
    r = subprocess.run([b, "model", "show", str(d), "-o", "json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    assert (shown["seq_len"], shown["max_position_embeddings"]) == (4096, 131072)
    assert shown == spec_from_config(LLAMA31, "Llama-3.1", str(d / "config.json")).to_dict()


SPEC = dict(name="t", layers=2, hidden=32, heads=4, seq_len=16, vocab=64)


@pytest.mark.parametrize("flag,value,key,planned", [("--seq-len", "32", "seq_len", 16),
                                                     ("--global-batch", "8", "global_batch", 4)])
def test_the_trainer_refuses_a_flag_that_contradicts_its_plan(tmp_path, flag, value, key, planned):
    plan = hand_plan(SPEC, 4, 4, [dict(micro_batches=1, stages=[dict(layers=[0, 2], tp=1, dp=1, gpus=[("n", 0)])])])
    plan["seq_len"] = 16
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    r = subprocess.run([PYTHON, "-m", "motley_torch.train", "--plan", str(path), flag, value, "--steps", "1"],
                       capture_output=True, text=True, timeout=120, env=python_env())
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2, r.stderr
    assert last.startswith(f"motley_torch.train: {flag}: {value}, but the plan ({path}) has {key} {planned}"), r.stderr
    # Repeating the plan's value is no contradiction: the run goes on to join the job (and,
    # outside one, fails there for want of the rank's environment, not for the flag).
    r = subprocess.run([PYTHON, "-m", "motley_torch.train", "--plan", str(path), flag, str(planned), "--steps", "1"],
                       capture_output=True, text=True, timeout=120, env=python_env())
    assert f"{flag}:" not in r.stderr, r.stderr
