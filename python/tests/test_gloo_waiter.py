"""Keep-going's waits over gloo (distributed/keep_going.py, `GlooWaiter`): a receive whose
sender comes later than a wait slice still completes (a timed gloo wait would have closed the
group's pairs: "Application timeout caused pair closure"), and a rank that gives up on a wait
does so within a slice while the wait's thread still finishes it."""

from launcher import two_gloo_ranks

WORKER = r"""
import sys, time, torch, torch.distributed as dist
from motley_torch.distributed.keep_going import GlooWaiter, _GaveUp, WAIT_SLICE_S

rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
late = 3 * WAIT_SLICE_S + 0.1
if rank == 0:
    time.sleep(late)
    dist.send(torch.ones(3), dst=1)
    time.sleep(late)
    dist.send(torch.full((3,), 2.0), dst=1)
else:
    waiter = GlooWaiter()
    t, t0 = torch.zeros(3), time.monotonic()
    waiter.wait(dist.irecv(t, src=0), lambda: False)
    print("late", time.monotonic() - t0 >= 3 * WAIT_SLICE_S, t.tolist(), flush=True)
    t2, t0 = torch.zeros(3), time.monotonic()
    try:
        waiter.wait(dist.irecv(t2, src=0), lambda: time.monotonic() - t0 > 0.1)
        print("waited", flush=True)
    except _GaveUp:
        print("gave up within two slices", time.monotonic() - t0 < 2 * WAIT_SLICE_S + 0.1, flush=True)
    waiter.retire()
    time.sleep(late + 1.0)
    print("finished by its thread", t2.tolist(), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_a_late_sender_completes_and_a_given_up_wait_is_finished_by_its_thread():
    lines = two_gloo_ranks(WORKER)[1].splitlines()
    assert lines == ["late True [1.0, 1.0, 1.0]", "gave up within two slices True",
                     "finished by its thread [2.0, 2.0, 2.0]"], lines
