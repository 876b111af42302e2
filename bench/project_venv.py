"""The project's venv for the benches that run ranks through the real system: they need torch
(the ranks and the profiler run with the bench's own interpreter) and pyyaml. Run with another
Python, such a bench re-executes itself with the venv's (~/.cache/motley/venv, or MOTLEY_VENV;
python/run-tests makes it)."""

import os
import sys
from pathlib import Path

VENV_PY = Path(os.environ.get("MOTLEY_VENV", Path.home() / ".cache" / "motley" / "venv")) / "bin" / "python"


def use_project_venv(bench: str):
    """Return when torch and pyyaml import here; else re-execute this program with the venv's
    Python, or exit naming what is missing."""
    try:
        import torch  # noqa: F401
        import yaml  # noqa: F401
    except ImportError:
        if VENV_PY.exists() and Path(sys.prefix).resolve() != VENV_PY.parent.parent.resolve():
            os.execv(str(VENV_PY), [str(VENV_PY), *sys.argv])
        sys.exit(f"{bench}: torch and pyyaml are missing; run python/run-tests once to make the venv ({VENV_PY})")
