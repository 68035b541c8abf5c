"""engine/pending_output.PendingOutput.tokens_of: a step's draws for the next step's rows, by
request, whatever order the next step lists them in (async scheduling)."""

from __future__ import annotations

import torch

from prefixkv.engine.model_runner_output import ModelRunnerOutput
from prefixkv.engine.pending_output import PendingOutput
from prefixkv.engine.sampler import SampledTensors

CPU = torch.device("cpu")


def _pending() -> PendingOutput:
    tokens = torch.tensor([11, 22, 33])
    return PendingOutput(ModelRunnerOutput(), ["a", "b", "c"], SampledTensors(tokens, 3))


def test_the_same_rows_in_the_same_order_are_the_draws_themselves():
    assert _pending().tokens_of(["a", "b", "c"], CPU).tolist() == [11, 22, 33]


def test_other_orders_and_subsets_map_by_request():
    pending = _pending()
    assert pending.tokens_of(["c", "a"], CPU).tolist() == [33, 11]
    assert pending.tokens_of(["b"], CPU).tolist() == [22]
    assert pending.tokens_of(["a", "b", "c", "d"], CPU).tolist() == [11, 22, 33, 0]  # "d": nothing drawn


def test_a_step_that_drew_nothing_gives_zeros():
    pending = PendingOutput(ModelRunnerOutput())
    assert pending.tokens_of(["a", "b"], CPU).tolist() == [0, 0]
