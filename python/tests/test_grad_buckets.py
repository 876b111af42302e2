"""The overlapped gradient sync's buckets (distributed/overlap.py, "Gradients as views of their
bucket"): with fp32 parameters every gradient is a view of its bucket's flat buffer, the
backward passes of several micro-batches accumulate into it in place, the all-reduce sums it
there and nothing is copied back; a bucket holding another type (a bf16 parameter) is copied as
before. Two gloo ranks on localhost; every sum checked against the gradients each rank computes
alone."""

import json

from launcher import two_gloo_ranks

WORKER = r"""
import json, sys, types, torch, torch.distributed as dist
from motley_torch.distributed.overlap import OverlappedReducer

rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
torch.manual_seed(0)  # the same weights on both ranks
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
model[2].to(torch.bfloat16)  # its bucket (the first: buckets go in reverse order) is copied
view = types.SimpleNamespace(segments=[types.SimpleNamespace(layers=(0, 1), group=types.SimpleNamespace(pg=None))],
                             wait=lambda work: work.wait())
# 1 KiB buckets, cut in reverse order: [2.bias, 2.weight, 1.bias] (bf16 with fp32: copied),
# [1.weight], [0.bias, 0.weight] (fp32: views).
red = OverlappedReducer(view, list(model.named_parameters()), lambda name: 0, 1 / 1024)
gen = torch.Generator().manual_seed(10 + rank)  # each rank its own micro-batches
xs = [torch.randn(3, 8, generator=gen) for _ in range(2)]

def backward_all():
    for x in xs:
        model[2](model[1](model[0](x)).bfloat16()).float().square().sum().backward()

# Alone: the rank's own gradients, summed over its micro-batches.
backward_all()
alone = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
model.zero_grad(set_to_none=True)
for step in range(2):  # a second step: the buffers zeroed and attached again
    red.start_step(len(xs))
    backward_all()
    red.finish()
    views = []
    for b in red.buckets:
        for p in b.params:
            inside = b.buffer is not None and b.buffer.data_ptr() <= p.grad.data_ptr() < b.buffer.data_ptr() + b.buffer.numel() * 4
            views.append([str(p.dtype), inside])
    grads = {n: p.grad.detach().float().tolist() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
print(json.dumps({"alone": {n: g.tolist() for n, g in alone.items()}, "summed": grads, "views": views,
                  "buckets": len(red.buckets)}), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_fp32_gradients_are_views_of_their_bucket_and_sum_in_place():
    import torch

    r0, r1 = (json.loads(out.strip().splitlines()[-1]) for out in two_gloo_ranks(WORKER))
    assert r0["buckets"] == 3
    # The bucket that holds the bf16 layer is copied (its fp32 bias too); every other gradient
    # lies inside its bucket's buffer.
    assert r0["views"] == [["torch.bfloat16", False]] * 2 + [["torch.float32", False]] + [["torch.float32", True]] * 3
    for name, g in r0["summed"].items():
        want = torch.tensor(r0["alone"][name]) + torch.tensor(r1["alone"][name])
        # The bf16 layer's sum is rounded to bf16 (8 bits of mantissa) when it is written back.
        tol = 1e-2 if name.startswith("2.") else 1e-5
        assert torch.allclose(torch.tensor(g), want, rtol=tol, atol=1e-6), name
        assert torch.equal(torch.tensor(g), torch.tensor(r1["summed"][name])), name
        assert not torch.allclose(want, torch.tensor(r0["alone"][name])), name  # the peer's part is in it
