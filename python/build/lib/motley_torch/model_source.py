"""Where a model spec comes from: a model file (YAML or JSON), a Hugging Face model directory
(or its config.json), or a name in the coordinator's catalog (`motley model show`).
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Optional

from .models.hf import is_hf_model, spec_from_hf
from .spec import ModelSpec, PlanError


def load_model(ref: str, motley_bin: Optional[str] = None) -> ModelSpec:
    """A model file (YAML or JSON), a Hugging Face model directory or its config.json, or a
    catalog name (resolved by `motley model show NAME -o json`)."""
    if is_hf_model(ref):
        return spec_from_hf(ref)
    if os.path.exists(ref):
        with open(ref) as f:
            text = f.read()
        try:
            import yaml

            doc = yaml.safe_load(text)
        except ImportError:  # pragma: no cover - pyyaml is a dependency
            doc = json.loads(text)
        return ModelSpec.from_dict(doc, where=f"model file {ref}")
    exe = motley_bin or os.environ.get("MOTLEY_BIN") or "motley"
    try:
        out = subprocess.run([exe, "model", "show", ref, "-o", "json"], capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise PlanError(f"--model: {ref!r} is not a file and `{exe} model show` could not run ({e}); pass a model YAML file")
    if out.returncode != 0:
        raise PlanError(f"--model: {ref!r} is not a file and `{exe} model show {ref}` failed: {out.stderr.strip()[:300]}")
    return ModelSpec.from_dict(json.loads(out.stdout), where=f"motley model show {ref}")
