"""An emulated GPU's CPU share (docs/emulation.md, "Start-up outside the share").

On a node whose GPUs are emulated on the CPU (`emulate: {cpu: F}`), the agent hands each rank,
and its layer profiler, the `cgroup.procs` of a cgroup that holds F of one core in
`MOTLEY_CPU_SHARE_PROCS`. The process writes itself in once its runtime is loaded: held to a
few milliseconds of every period from its first instruction, importing torch (hundreds of MiB of
libraries to map and relocate) takes minutes and many times the CPU time it takes unconfined,
where the work the share emulates is the training or the measuring that follows. A rank that
does not enter is moved there by its agent after a start-up allowance.
"""

from __future__ import annotations

import os
import sys

ENTER_ENV = "MOTLEY_CPU_SHARE_PROCS"
ENTERED_LINE = "motley-cpu-share: entered "


class CpuShareError(RuntimeError):
    """The share named by the agent could not be entered: running outside it would time or
    train the whole machine's CPU, not the emulated device."""


def enter_share() -> bool:
    """Move this process into the CPU share its agent named, if any: whether it did."""
    path = os.environ.get(ENTER_ENV, "").strip()
    if not path:
        return False
    if not os.path.isabs(path) or os.path.basename(path) != "cgroup.procs":
        raise CpuShareError(f"{ENTER_ENV}: {path!r} is not the absolute path of a cgroup.procs file")
    try:
        with open(path, "w") as f:
            f.write("0")
    except OSError as e:
        raise CpuShareError(f"{ENTER_ENV}: cannot enter the CPU share {path}: {e}") from e
    # The agent refuses a layer profile whose log lacks this line (agent/src/profiler.rs).
    print(f"{ENTERED_LINE}{path}", file=sys.stderr, flush=True)
    return True
