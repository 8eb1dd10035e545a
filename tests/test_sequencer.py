"""The served pool's ordering of a model's requests, as a pure function of what arrived
(trio_widgets/engine/sequencer.py): no server, no clock."""

from __future__ import annotations

import pytest

import trio_widgets as trio
from trio_widgets.engine.sequencer import Sequencer


def ran(seq: Sequencer[str], arrivals: list[tuple[int | None, str]]) -> list[str]:
    """The order in which the caller launches requests arriving in this order."""
    out = []
    for n, item in arrivals:
        arrival = seq.arrive(n, item)
        if arrival.kind == "run":
            out += [arrival.item, *arrival.ready]
    return out


def test_in_order_runs_at_once():
    assert ran(Sequencer(), [(1, "a"), (2, "b"), (3, "c")]) == ["a", "b", "c"]


def test_out_of_order_is_held_until_its_predecessor_comes():
    seq: Sequencer[str] = Sequencer()
    assert ran(seq, [(3, "c"), (2, "b")]) == []
    assert seq.waiting
    assert ran(seq, [(1, "a")]) == ["a", "b", "c"]
    assert not seq.waiting and seq.last == 3


def test_a_repeat_is_the_first_request_and_runs_nothing():
    seq: Sequencer[str] = Sequencer()
    assert ran(seq, [(1, "a")]) == ["a"]
    again = seq.arrive(1, "a-retry")
    assert (again.kind, again.item, again.ready) == ("duplicate", "a", [])
    held = seq.arrive(5, "e")
    assert held.kind == "held" and seq.arrive(5, "e-retry").item == "e"


def test_a_refused_seq_id_is_stepped_over():
    seq: Sequencer[str] = Sequencer()
    assert ran(seq, [(2, "b"), (3, "c")]) == []
    assert seq.refuse(1) == ["b", "c"]  # 1 was refused before it was queued: its successors go on
    assert seq.refuse(9) == [] and seq.waiting  # ahead of time: a placeholder, stepped over later
    assert ran(seq, [(4, "d")]) == ["d"]
    assert seq.skip_gap() == (5, 8, [])
    assert ran(seq, [(10, "j")]) == ["j"] and not seq.waiting


def test_a_gap_that_never_fills_is_skipped_then_a_late_arrival_still_runs():
    seq: Sequencer[str] = Sequencer()
    assert ran(seq, [(1, "a"), (4, "d"), (5, "e")]) == ["a"]
    assert seq.skip_gap() == (2, 3, ["d", "e"])
    assert not seq.waiting
    assert ran(seq, [(2, "b")]) == ["b"]  # late: its gap was skipped, it runs on arrival


def test_unseen_after_a_refused_launch_lets_a_retry_run():
    seq: Sequencer[str] = Sequencer()
    assert seq.arrive(1, "a").kind == "run"
    seq.unsee(1)  # the launch was refused: no request id was given out
    assert seq.arrive(1, "a-retry").kind == "run"


def test_unnumbered_requests_run_at_once_without_deduplication():
    seq: Sequencer[str] = Sequencer()
    assert ran(seq, [(None, "x"), (None, "x")]) == ["x", "x"]


@pytest.mark.parametrize("bad", [-1, 2**31, 1.0, "1", True])
def test_a_bad_seq_id_is_refused_naming_the_field(bad):
    with pytest.raises(trio.InvalidInputError) as info:
        Sequencer().arrive(bad, "x")
    assert info.value.field == "seq_id"


def test_bounded_what_is_held_and_what_is_remembered():
    seq: Sequencer[int] = Sequencer(seen=4, held=2)
    seq.arrive(3, 3)
    seq.arrive(4, 4)
    with pytest.raises(trio.InvalidInputError, match="already wait"):
        seq.arrive(5, 5)
    assert seq.drop_held() == [3, 4] and not seq.waiting
    seq = Sequencer(seen=4, held=2)
    for n in range(1, 8):
        seq.arrive(n, n)
    assert len(seq.seen) == 4
    with pytest.raises(trio.InvalidInputError, match="older than the last 4"):
        seq.arrive(1, 1)
