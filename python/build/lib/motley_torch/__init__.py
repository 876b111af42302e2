"""motley_torch: run a Motley plan (mixed GPU clusters) with PyTorch.

    import motley_torch
    view = motley_torch.init()          # in a rank started by the Motley agent
    view.layers, view.tp_group, view.pp_prev_ranks, view.segments, ...

See python/README.md.
"""

from .model_source import load_model
from .plan import Plan
from .spec import ModelSpec, PlanError

__all__ = ["init", "RankView", "Plan", "PlanError", "ModelSpec", "load_model",
           "ColumnParallelLinear", "RowParallelLinear", "one_f_one_b", "Pipeline", "allreduce_gradients"]

__version__ = "0.1.0"


def __getattr__(name):
    # torch is imported lazily: the plan helpers work without it.
    if name in ("init", "RankView", "RankEnvError"):
        from .distributed import groups

        return getattr(groups, name)
    if name in ("ColumnParallelLinear", "RowParallelLinear"):
        from .models import tp

        return getattr(tp, name)
    if name in ("one_f_one_b", "Pipeline", "allreduce_gradients"):
        from .distributed import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'motley_torch' has no attribute {name!r}")
