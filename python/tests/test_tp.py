"""Tensor-parallel layers (two gloo ranks) match plain nn.Linear and the unsharded model."""

import subprocess
import sys
from pathlib import Path

from launcher import free_port, python_env

HERE = Path(__file__).resolve().parent


def test_tp_layers_match_plain_linear_and_the_full_model():
    port = str(free_port())
    procs = []
    for r in range(2):
        env = python_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(HERE / "tp_worker.py")], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        outs.append((p.returncode, out))
    for rc, out in outs:
        assert rc == 0, out
        assert " ok" in out
