"""speculative_config: vLLM's spelling and defaults; everything not implemented refused by name."""

from __future__ import annotations

import pytest

from prefixkv.speculative import SpeculativeConfig


def test_vllm_defaults_for_the_lookup_sizes():
    one = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    older = SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (older.method, older.prompt_lookup_min, older.prompt_lookup_max) == ("ngram", 2, 2)
    assert SpeculativeConfig.parse(None) is None
    assert one.by_measured_cost  # prefixkv's budget, on unless turned off
    vllm_like = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "by_measured_cost": False})
    assert not vllm_like.by_measured_cost


@pytest.mark.parametrize(
    "value, message",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method='eagle' is not implemented"),
        ({"method": "suffix", "num_speculative_tokens": 2}, "method='suffix' is not implemented"),
        ({"method": "nope", "num_speculative_tokens": 2}, "method='nope' is unknown"),
        ({"model": "/models/draft", "num_speculative_tokens": 2}, "draft models are not implemented"),
        ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "> prompt"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "not implemented"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1}, "disable_by_batch_size"),
        ({"method": "ngram", "num_speculative_tokens": 2, "by_measured_cost": "yes"}, "by_measured_cost"),
        ("ngram", "must be a dict"),
    ],
)
def test_refused_by_name(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_a_key_without_effect_is_accepted_and_logged_once(caplog):
    from prefixkv.speculative import config as module

    module._logged.discard("enforce_eager")
    value = {"method": "ngram", "num_speculative_tokens": 2, "enforce_eager": True}
    with caplog.at_level("INFO", logger="prefixkv"):
        assert SpeculativeConfig.parse(value) is not None
        assert SpeculativeConfig.parse(value) is not None
    said = [r.getMessage() for r in caplog.records if "enforce_eager" in r.getMessage()]
    assert said == [
        "speculative_config enforce_eager changes nothing here: the n-gram method runs no draft model to capture or not"
    ]
