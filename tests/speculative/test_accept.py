"""Which rows a verification step keeps, and the seeded generators set back to the rows kept."""

from __future__ import annotations

import torch

from prefixkv.speculative import keep_accepted, rewind_generators


def test_rows_kept_up_to_the_first_rejected_draft():
    # a: drafts 5 6 7 -> its rows drew 5 6 9 8: 5 and 6 kept, then 9 (the model's own), 8 dropped
    # b: no drafts, one row; c: drafts 3 -> drew 4, 3: the draft is rejected, 4 kept
    ids = ["a", "a", "a", "a", "b", "c", "c"]
    tokens = [5, 6, 9, 8, 1, 4, 3]
    logprobs = [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6, -0.7]
    kept_ids, kept_tokens, (kept_lps,), accepted = keep_accepted(
        ids, tokens, {"a": [5, 6, 7], "c": [3]}, {}, (logprobs,)
    )
    assert kept_ids == ["a", "a", "a", "b", "c"]
    assert kept_tokens == [5, 6, 9, 1, 4]
    assert kept_lps == [-0.1, -0.2, -0.3, -0.5, -0.6]
    assert accepted == {"a": 2, "c": 0}


def test_every_draft_kept_gives_the_bonus_row_and_a_failed_request_keeps_none():
    ids, tokens = ["a", "a", "a", "b", "b"], [5, 6, 2, 7, 7]
    kept_ids, kept_tokens, _, accepted = keep_accepted(ids, tokens, {"a": [5, 6], "b": [7]}, {"b": "broken"}, (None,))
    assert (kept_ids, kept_tokens, accepted) == (["a", "a", "a"], [5, 6, 2], {"a": 2})


def test_a_generator_set_back_draws_what_a_step_without_drafts_would():
    g, reference = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    before = g.get_state()
    torch.rand(4, generator=g, dtype=torch.float64)  # a step that drew 4 rows
    rewind_generators({"a": (g, before)}, {"a": 1})  # kept 1 draft: 2 rows' uniforms used
    torch.rand(2, generator=reference, dtype=torch.float64)
    assert torch.equal(
        torch.rand(3, generator=g, dtype=torch.float64), torch.rand(3, generator=reference, dtype=torch.float64)
    )
