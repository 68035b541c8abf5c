"""The n-gram drafter: the longest suffix match first, the latest occurrence, bounded by room."""

from __future__ import annotations

from prefixkv.speculative import NgramDrafter, SpeculativeConfig


def drafter(k: int = 3, lo: int = 1, hi: int = 3) -> NgramDrafter:
    config = SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo, "prompt_lookup_max": hi}
    )
    assert config is not None
    made = config.drafter(max_model_len=1000)
    assert isinstance(made, NgramDrafter)
    return made


def test_the_tokens_after_the_latest_longest_match():
    d = drafter()
    # "7 8" occurred twice; its latest occurrence was followed by 9 10 11, the first by 1 2
    tokens = [7, 8, 1, 2, 5, 7, 8, 9, 10, 11, 6, 7, 8]
    assert d.propose("a", tokens, room=5) == [9, 10, 11]
    assert d.propose("b", tokens, room=2) == [9, 10]  # room bounds it
    # a longer match wins over a later shorter one: "5 7 8" -> 9; "3 8" -> 4 is later but shorter
    d2 = drafter(k=2)
    assert d2.propose("c", [5, 7, 8, 9, 9, 3, 8, 4, 0, 5, 7, 8], room=4) == [9, 9]


def test_nothing_without_a_match_or_room():
    d = drafter(lo=2)
    assert d.propose("a", [1, 2, 3, 4], room=3) == []  # no 2-gram repeats
    assert d.propose("b", [1, 2, 1, 2], room=0) == []
    assert d.propose("c", [1], room=3) == []


def test_the_index_grows_with_the_sequence():
    d = drafter(k=2, lo=1, hi=2)
    tokens = [1, 2, 3]
    assert d.propose("a", tokens, room=2) == []
    tokens += [1]  # "1" was followed by 2 3
    assert d.propose("a", tokens, room=2) == [2, 3]
    tokens += [5, 1]  # the latest "1" (now followed by 5) wins
    assert d.propose("a", tokens, room=2) == [5, 1]
    d.forget("a")
    assert "a" not in d._indexes
