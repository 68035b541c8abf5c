"""The draft budget: drafts where they raise the step's expected tokens per second, by the step
times measured per row count and each request's share of drafts kept."""

from __future__ import annotations

from prefixkv.speculative import DraftBudget
from prefixkv.speculative.budget import PROBE_AFTER


def test_untimed_rows_are_tried():
    budget = DraftBudget()
    budget.start_step(1)
    assert budget.length("a", 4) == 4  # nothing timed: the drafts run, and their time is measured
    budget.record_step(1, 0.010)
    budget.start_step(1)
    assert budget.length("a", 4) == 4  # 2-5 rows untimed: taken as costing what 1 row costs


def test_drafts_stop_where_the_rows_cost_more_than_they_make():
    budget = DraftBudget()
    for rows, ms in ((1, 14.0), (4, 16.0), (5, 17.0), (8, 20.0), (16, 31.7), (17, 50.0)):
        budget.record_step(rows, ms / 1000)
    for _ in range(10):
        budget.record_verified("a", 4, 4)
    budget.start_step(1)
    assert budget.length("a", 4) == 4  # 5 rows: 1.2x the time for about 5x the tokens
    budget.start_step(16)  # a full one-call decode step: a 17th row costs 1.6x
    assert budget.length("b", 4) == 0


def test_a_request_that_keeps_few_drafts_gets_fewer():
    budget = DraftBudget()
    for rows, ms in ((1, 14.0), (2, 14.8), (3, 15.6), (4, 16.4), (5, 17.2)):
        budget.record_step(rows, ms / 1000)
    for _ in range(10):
        budget.record_verified("low", 4, 0)
        budget.record_verified("high", 4, 4)
    budget.start_step(1)
    assert budget.length("high", 4) == 4
    budget.start_step(1)
    assert budget.length("low", 4) == 0


def test_a_refused_request_is_probed_again():
    budget = DraftBudget()
    budget.record_step(1, 0.010)
    budget.record_step(2, 0.030)  # a draft row triples the step
    given = []
    for _ in range(PROBE_AFTER):
        budget.start_step(1)
        given.append(budget.length("a", 2))
    assert given == [0] * (PROBE_AFTER - 1) + [1]
    budget.forget("a")
    budget.start_step(1)
    assert budget.length("a", 2) == 0


def test_a_time_not_measured_lately_is_measured_again():
    """The machine's speed drifts: a row count's time from long ago does not keep drafts off."""
    from prefixkv.speculative.budget import STALE_AFTER

    budget = DraftBudget()
    budget.record_step(1, 0.010)
    budget.record_step(2, 0.030)
    budget.start_step(1)
    assert budget.length("a", 1) == 0
    for _ in range(STALE_AFTER + 1):
        budget.record_step(1, 0.010)
    budget.start_step(1)
    assert budget.length("a", 1) == 1  # 2 rows are taken as costing 1 row's time until timed again


def test_kept_drafts_come_in_runs():
    """A request that keeps all four drafts or none, half the time each: its first draft is kept
    half the time, and every later one whenever the one before it was."""
    budget = DraftBudget()
    for _ in range(20):
        budget.record_verified("a", 4, 4)
        budget.record_verified("a", 4, 0)
    budget.record_verified("a", 4, 4)
    chances = budget._kept_chances("a", 4)
    assert 0.5 < chances[0] < 0.8
    assert all(later > 0.97 * chances[0] for later in chances[1:])  # not 0.5^j
    budget.record_verified("b", 3, 1)  # kept the first, not the second
    assert budget._after[0] < 1.0 and budget._after[2] > 0.99  # position 4 was not offered
