"""`--torch-profile DIR`: torch.profiler over two steps of a rank's run (the third and fourth
after the start, past compilation and warm-up), written as DIR/kernels.rank{R}.txt (the
operators and kernels by their total device time, CPU time where there is no device) and
DIR/trace.rank{R}.json.gz (Chrome trace, for Perfetto), as torchtitan's profiling does.
Everything else in the step is unchanged; timings of the profiled steps include the
profiler's own overhead."""

from __future__ import annotations

import os
from typing import Optional

import torch

FIRST_OFFSET = 3  # steps after the run's first before the profiler starts
STEPS = 2


class StepProfiler:
    def __init__(self, out_dir: str, start: int, rank: int, device: torch.device):
        if not os.path.isabs(out_dir):
            out_dir = os.path.abspath(out_dir)
        os.makedirs(out_dir, exist_ok=True)
        self.dir, self.rank, self.device = out_dir, rank, device
        self.first = start + FIRST_OFFSET
        self.prof: Optional[torch.profiler.profile] = None

    def before(self, step: int):
        if step != self.first:
            return
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=acts)
        self.prof.__enter__()

    def after(self, step: int):
        if self.prof is None or step != self.first + STEPS - 1:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.prof.__exit__(None, None, None)
        key = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = self.prof.key_averages().table(sort_by=key, row_limit=60, max_name_column_width=90)
        path = os.path.join(self.dir, f"kernels.rank{self.rank}.txt")
        with open(path + ".tmp", "w") as f:
            f.write(f"# steps {self.first}..{self.first + STEPS - 1}, sorted by {key}\n{table}\n")
        os.replace(path + ".tmp", path)
        self.prof.export_chrome_trace(os.path.join(self.dir, f"trace.rank{self.rank}.json.gz"))
        self.prof = None
