"""How a rank process ends once it has nothing left to do: at once, with its code, without the
interpreter's teardown."""

from __future__ import annotations

import os
import sys


def end_rank(code: int):
    """End the process with `code` now. In the interpreter's teardown, C++ threads of gloo, the
    store and the profiler that still hold Python objects can abort the process (SIGABRT,
    "terminate called without an active exception": exit -6 after a run that succeeded, or in
    place of a run's own error code), and the agent would take the rank for a failed one. What
    the teardown would have done that matters is done first: the standard streams flushed,
    inductor's compile workers (processes that inherited the rank's log, which would keep the
    agent's end of it open) stopped, logging's handlers flushed. The caller has closed its files
    and written what it writes (a checkpoint file still being written was never renamed into
    place, so it is never taken for a whole one: docs/checkpoint.md)."""
    import logging

    sys.stdout.flush()
    sys.stderr.flush()
    compile_workers = sys.modules.get("torch._inductor.async_compile")
    if compile_workers is not None:
        try:
            compile_workers.shutdown_compile_workers()
        except Exception as e:  # the exit code is the run's; a worker left behind is said
            print(f"motley_torch: stopping inductor's compile workers: {e}", file=sys.stderr, flush=True)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
