"""The 1F1B order, that it cannot deadlock with uneven micro-batch counts, and the hop pairs
between stages of different dp."""

import itertools

import pytest

from motley_torch.distributed.pipeline import one_f_one_b


def test_1f1b_order_of_a_four_stage_pipeline():
    assert one_f_one_b(4, 0, 6) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1),
                                    ("F", 5), ("B", 2), ("B", 3), ("B", 4), ("B", 5)]
    assert one_f_one_b(4, 3, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert one_f_one_b(4, 1, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]  # fewer micro-batches than warm-up
    assert one_f_one_b(1, 0, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    with pytest.raises(ValueError):
        one_f_one_b(2, 2, 1)


@pytest.mark.parametrize("stages,micro", list(itertools.product([1, 2, 3, 5], [1, 2, 3, 7])))
def test_1f1b_runs_every_micro_batch_once_and_never_deadlocks(stages, micro):
    """Simulate the stages with non-blocking sends and blocking receives: forward k at stage s
    needs forward k of s-1; backward k needs backward k of s+1 (or, last stage, forward k)."""
    orders = [one_f_one_b(stages, s, micro) for s in range(stages)]
    for o in orders:
        assert sorted(o) == sorted([("F", k) for k in range(micro)] + [("B", k) for k in range(micro)])
        # a backward never comes before its forward; in-flight forwards never exceed the depth
        done = set()
        for i, (w, k) in enumerate(o):
            if w == "B":
                assert ("F", k) in done
            done.add((w, k))
    pos = [0] * stages
    finished = set()
    while any(pos[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if pos[s] == len(orders[s]):
                continue
            w, k = orders[s][pos[s]]
            ready = (w == "F" and (s == 0 or (s - 1, "F", k) in finished)) or (
                w == "B" and ((s == stages - 1 and (s, "F", k) in finished) or (s + 1, "B", k) in finished))
            if ready:
                finished.add((s, w, k))
                pos[s] += 1
                progressed = True
        assert progressed, f"deadlock at {pos}"
