"""The reward memo's policy (mugrpo_async.rewards.memo): which pairs are known, queued and sent, and what a
lost scorer costs. Pure logic, no Ray: the scores are fed by hand as a scorer would stream them."""

from __future__ import annotations

import pytest

from mugrpo_async.rewards.memo import GRACE_S, PairBook, pair_deadline_s


def _feed(book: PairBook, scores: dict) -> None:
    """Stream every pending batch's scores, in order, from ``scores`` (text -> reward; failed when < 0)."""
    while (batch := book.next_batch()) is not None:
        r = scores[batch.pairs[batch.done][0]]
        book.scored(batch, (max(r, 0.0), r < 0))


def test_distinct_pairs_are_batched_round_robin_and_scored_once():
    book = PairBook(num_scorers=2, batch_size=3)
    assert book.add(["a", "a", "b"], "1") is None  # 2 distinct pairs wait
    first = book.add(["c", "a", "d"], "1")  # ("a", "1") is queued already: the group's c and d make 4 >= 3
    assert first.pairs == [("a", "1"), ("b", "1"), ("c", "1"), ("d", "1")] and first.scorer == 0
    assert book.waiting == []
    assert book.add(["a"], "2") is None  # same text, another reference: a new pair
    last = book.flush()
    assert last.pairs == [("a", "2")] and last.scorer == 1 and book.flush() is None
    _feed(book, {"a": 1.0, "b": 0.0, "c": 1.0, "d": 0.0})
    rewards, failures = book.finish([["a", "a", "b"], ["c", "a", "d"], ["a"]], ["1", "1", "2"])
    assert rewards == [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0]] and failures == 0
    assert book.known == {("a", "1"): 1.0, ("b", "1"): 0.0, ("c", "1"): 1.0, ("d", "1"): 0.0, ("a", "2"): 1.0}
    assert book.add(["a", "b", "c"], "1") is None and book.flush() is None  # all known: nothing to send
    assert book.finish([["a", "b", "c"]], ["1"]) == ([[1.0, 0.0, 1.0]], 0)


def test_failures_score_zero_are_counted_and_not_remembered():
    book = PairBook(num_scorers=1, batch_size=8)
    book.add(["ok", "bad"], "1")
    book.flush()
    _feed(book, {"ok": 1.0, "bad": -1.0})
    assert book.finish([["ok", "bad", "bad"]], ["1"]) == ([[1.0, 0.0, 0.0]], 1)  # one failed pair, counted once
    assert ("bad", "1") not in book.known and book.known == {("ok", "1"): 1.0}
    batch = book.add(["bad"], "1") or book.flush()
    assert batch.pairs == [("bad", "1")]  # a failure is scored again next time


def test_oldest_known_pairs_are_forgotten_past_the_limit():
    book = PairBook(num_scorers=1, batch_size=10, limit=2)
    for text in ("x", "y", "z"):
        book.add([text], "1")
        book.flush()
        _feed(book, {text: 1.0})
        book.finish([[text]], ["1"])
    assert list(book.known) == [("y", "1"), ("z", "1")]


def test_finish_refuses_unscored_pairs():
    book = PairBook(num_scorers=1)
    book.add(["a"], "1")
    with pytest.raises(RuntimeError, match="unscored"):
        book.finish([["a"]], ["1"])


def test_stuck_scorer_fails_the_pair_in_progress_and_resends_the_rest():
    book = PairBook(num_scorers=2, batch_size=3)
    b0 = book.add(["a", "b", "c"], "1")  # scorer 0
    b1 = book.add(["d", "e", "f"], "1")  # scorer 1
    b2 = book.add(["g", "h"], "1") or book.flush()  # scorer 0, queued behind b0
    assert (b0.scorer, b1.scorer, b2.scorer) == (0, 1, 0)
    book.scored(b0, (1.0, False))  # a scored; the scorer then hangs on b
    assert book.next_batch() is b0
    resend = book.scorer_lost(0, stuck=True)
    assert book.results[("b", "1")] == (0.0, True)
    assert [r.pairs for r in resend] == [[("c", "1"), ("g", "1"), ("h", "1")]]
    assert [b.id for b in book.pending] == [b1.id, resend[0].id]  # b0 and b2 are gone, b1 untouched
    _feed(book, {"c": 1.0, "d": 0.0, "e": 1.0, "f": 0.0, "g": 1.0, "h": 0.0})
    rewards, failures = book.finish([["a", "b", "c", "d", "e", "f", "g", "h"]], ["1"])
    assert rewards == [[1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]] and failures == 1
    assert ("b", "1") not in book.known and len(book.known) == 7


def test_dead_scorer_gives_the_pair_in_progress_one_more_try():
    book = PairBook(num_scorers=1, batch_size=4)
    book.add(["a", "b", "c"], "1")
    book.flush()
    first = book.scorer_lost(0, stuck=False)  # died before any score: "a" charged once, all re-sent
    assert [r.pairs for r in first] == [[("a", "1"), ("b", "1"), ("c", "1")]] and book.results == {}
    book.scored(first[0], (1.0, False))  # a
    second = book.scorer_lost(0, stuck=False)  # died again, now on "b" (charged once): re-sent
    assert [r.pairs for r in second] == [[("b", "1"), ("c", "1")]]
    third = book.scorer_lost(0, stuck=False)  # and again on "b": its second charge scores it 0
    assert book.results[("b", "1")] == (0.0, True) and [r.pairs for r in third] == [[("c", "1")]]
    _feed(book, {"c": 1.0})
    assert book.finish([["a", "b", "c"]], ["1"]) == ([[1.0, 0.0, 1.0]], 1)
    assert book.charges == {}  # charges last one collection


def test_lost_scorer_with_nothing_pending_and_give_up():
    book = PairBook(num_scorers=2, batch_size=2)
    assert book.scorer_lost(1, stuck=True) == []
    batch = book.add(["a", "b"], "1")
    book.scored(batch, (1.0, False))
    book.give_up(batch)  # its scorer never came back
    assert book.next_batch() is None and book.results[("b", "1")] == (0.0, True)
    assert book.finish([["a", "b"]], ["1"]) == ([[1.0, 0.0]], 1)


def test_resent_batches_are_cut_to_batch_size():
    book = PairBook(num_scorers=2, batch_size=2)
    book.add(["a", "b"], "1")  # scorer 0
    book.add(["c", "d"], "1")  # scorer 1
    book.add(["e", "f"], "1")  # scorer 0
    resend = book.scorer_lost(0, stuck=True)  # "a" fails; b, e, f re-sent round robin
    assert [(r.scorer, r.pairs) for r in resend] == [(1, [("b", "1"), ("e", "1")]), (0, [("f", "1")])]


def test_deadline_is_one_alarm_plus_grace():
    assert pair_deadline_s(5.0) == 5 + GRACE_S
    assert pair_deadline_s(0.5) == 1 + GRACE_S  # math-verify's alarm takes whole seconds
    with pytest.raises(ValueError):
        PairBook(num_scorers=0)
