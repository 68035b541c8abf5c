"""A tier backend is one file plus one registration: a store defined here, registered under its
own URL scheme, serves a new engine's prefix (docs/tiers.md, "Adding a tier backend")."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from prefixkv.tiers import TierBackend, TierSpec, parse_spec, register_backend
from prefixkv.tiers.registry import BACKENDS, medium_of

from .conftest import all_free, engine, run, tier
from .test_engine_tiers import prompts

SHELVES: dict[str, dict[bytes, bytes]] = {}  # shelf name -> its values: shared by the engines of a test


class ShelfStore:
    """Values on a named shelf in this process: `shelf://NAME`."""

    name = "shelf"
    fast = False  # written by a background writer and read on a loader thread, as a remote store

    def __init__(self, shelf: str) -> None:
        self.spec = f"shelf://{shelf}"
        self.values = SHELVES.setdefault(shelf, {})

    def get(self, key: bytes) -> bytes | None:
        return self.values.get(key)

    def get_many(self, keys: Sequence[bytes], sizes: Sequence[int] | None = None) -> list[bytes | None]:
        return [self.values.get(k) for k in keys]

    def put(self, key: bytes, value: bytes) -> None:
        self.values[key] = value

    def contains(self, key: bytes) -> bool:
        return key in self.values

    def close(self) -> None:
        pass


def _parse(text: str) -> TierSpec:
    shelf = text.removeprefix("shelf://")
    if not shelf:
        raise ValueError(f"the shelf tier {text!r} names no shelf")
    return TierSpec("shelf", shelf)


@pytest.fixture
def shelf_backend():
    register_backend(
        TierBackend(
            name="shelf",
            medium="SHELF",
            prefixes=("shelf://",),
            parse=_parse,
            build=lambda spec: ShelfStore(spec.target),
            usage="shelf://NAME",
        )
    )
    yield
    del BACKENDS["shelf"]
    SHELVES.clear()


def test_a_registered_backend_serves_a_new_engine(tiny_model, tiny_loaded, shelf_backend):
    assert parse_spec("shelf://a") == TierSpec("shelf", "a") and medium_of("shelf") == "SHELF"
    with pytest.raises(ValueError, match="shelf://NAME"):  # the refusal lists the registered syntaxes
        parse_spec("nfs:/x")
    prompt = prompts(7, 1)[0]
    first = engine(tiny_model, tiny_loaded, kv_tier="shelf://a")
    tokens, cached = run(first, prompt)
    assert cached == 0
    first.tiers.flush()
    assert tier(first, "shelf").saves == 11 and len(SHELVES["a"]) == 11

    second = engine(tiny_model, tiny_loaded, kv_tier="shelf://a")  # a new pool: the shelf serves the prefix
    assert run(second, prompt) == (tokens, 36)
    assert tier(second, "shelf").hits == 9
    assert all_free(second)
    first.tiers.close()
    second.tiers.close()


def test_a_backend_name_is_registered_once(shelf_backend):
    with pytest.raises(ValueError, match="registered already"):
        register_backend(BACKENDS["shelf"])
