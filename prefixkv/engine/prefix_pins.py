"""Pinned prefixes named the way clients name them - prompt token ids, a tenant's cache salt, an
adapter - turned into the cache's pins (prefixkv/cache/pins.py), written down in a pin file when
the engine has one (pin_manifest.py) and pinned again from it at start."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any, Protocol, cast

from ..cache import KVCacheManager
from ..engine_args import EngineArgs
from ..lora.request import LoRARequest
from ..outputs import RequestOutput
from ..request import Request
from ..sampling_params import SamplingParams
from .input_processor import InputProcessor
from .pin_manifest import PinManifest, PinRecord

logger = logging.getLogger(__name__)

# computes a prefix through the engine (one generated token) and returns its tokens read from a
# cache (the pool or a KV tier) rather than computed
ComputePrefix = Callable[[list[int], str | None, LoRARequest | None], int]


class EngineLoop(Protocol):
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> str: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...


def computed_by(engine: EngineLoop) -> ComputePrefix:
    """Computing a prefix on an engine nothing else runs on yet (at start): one greedy token."""

    def compute(ids: list[int], cache_salt: str | None, lora: LoRARequest | None) -> int:
        params = SamplingParams(max_tokens=1, temperature=0.0)
        request_id = engine.add_request(ids, params, lora_request=lora, cache_salt=cache_salt)
        done: RequestOutput | None = None
        while engine.has_unfinished_requests():
            done = next((o for o in engine.step() if o.request_id == request_id and o.finished), done)
        if done is None or done.error is not None:
            raise RuntimeError(f"the prefix could not be computed: {done.error if done else 'no output'}")
        return done.num_cached_tokens or 0

    return compute


def pin_manifest(config: EngineArgs, model_id: str) -> PinManifest | None:
    return None if config.pinned_prefixes_file is None else PinManifest(config.pinned_prefixes_file, model_id)


class PrefixPins:
    """`inputs` tokenizes a prefix as a prompt is tokenized; `resolve_lora` gives an adapter the
    identity its blocks carry (the engine's LoRA manager); `on_change` republishes the engine's
    stats after a pin or unpin; `manifest`, where given, is rewritten after each."""

    def __init__(
        self,
        manager: KVCacheManager,
        inputs: InputProcessor,
        resolve_lora: Callable[[LoRARequest], tuple[LoRARequest, int]],
        on_change: Callable[[], None],
        manifest: PinManifest | None = None,
    ) -> None:
        self._manager = manager
        self._inputs = inputs
        self._resolve_lora = resolve_lora
        self._on_change = on_change
        self._manifest = manifest
        self._records: dict[int, PinRecord] = {}  # uid of the pin's last block -> how it was asked for
        self._ids = itertools.count()

    def token_ids(self, prefix: str | list[int] | list[dict[str, Any]], chat_template: str | None = None) -> list[int]:
        """A prefix given as text (tokenized as a prompt is), token ids, or chat messages (rendered
        without a generation prompt, as a chat request's system prompt is) - as token ids."""
        if isinstance(prefix, str):
            return self._inputs.tokenize(prefix)
        if prefix and all(isinstance(m, dict) for m in prefix):
            tokenizer = self._inputs.tokenizer
            text = tokenizer.apply_chat_template(
                cast("list[dict[str, Any]]", prefix),
                add_generation_prompt=False,
                tokenize=False,
                chat_template=chat_template,
            )
            return tokenizer.encode(cast(str, text), add_special_tokens=False)
        if prefix and all(isinstance(t, int) and not isinstance(t, bool) for t in prefix):
            return cast("list[int]", list(prefix))
        raise ValueError("pin_prefix takes a text, a list of token ids or a list of chat messages")

    def _request(self, prompt_token_ids: list[int], cache_salt: str | None, lora: LoRARequest | None) -> Request:
        if not prompt_token_ids:
            raise ValueError("a prefix to pin has at least one token")
        resolved = self._resolve_lora(lora)[0] if lora is not None else None
        return Request(f"pin-{next(self._ids)}", prompt_token_ids, lora_request=resolved, cache_salt=cache_salt)

    def pin(self, prompt_token_ids: list[int], cache_salt: str | None = None, lora: LoRARequest | None = None) -> int:
        """Pin the cached whole blocks of this prefix (compute it first: `LLM.pin_prefix` does);
        returns the tokens pinned. PinError (a ValueError) when nothing of it is cached or the pin
        would pass max_pinned_fraction."""
        pin = self._manager.pin(self._request(prompt_token_ids, cache_salt, lora))
        leaf = pin.blocks[-1].uid
        if leaf not in self._records:
            self._records[leaf] = PinRecord(tuple(prompt_token_ids), cache_salt, lora)
            self._write()
        self._on_change()
        return pin.num_tokens

    def unpin(self, prompt_token_ids: list[int], cache_salt: str | None = None, lora: LoRARequest | None = None) -> int:
        """Release the pin of this prefix (same tenant, same adapter); returns the tokens it held,
        0 when it was not pinned."""
        pin = self._manager.unpin(self._request(prompt_token_ids, cache_salt, lora))
        if pin is not None and self._records.pop(pin.blocks[-1].uid, None) is not None:
            self._write()
        self._on_change()
        return 0 if pin is None else pin.num_tokens

    def forget_dropped(self) -> None:
        """Let the file follow pins the cache dropped (a reset of the prefix cache)."""
        live = {pin.blocks[-1].uid for pin in self._manager.pins.pins()}
        if set(self._records) - live:
            self._records = {uid: r for uid, r in self._records.items() if uid in live}
            self._write()

    def restore(self, compute: ComputePrefix) -> None:
        """Pin again what the pin file lists (at start, before any request): each prefix computed
        once more - from a KV tier where one holds its blocks - then pinned. What cannot be pinned
        is named in a warning; the file is then rewritten to what is pinned."""
        if self._manifest is None:
            return
        records, problems = self._manifest.read()
        pinned = from_cache = 0
        for record in records:
            ids = list(record.token_ids)
            try:
                self._inputs.validate_prompt(ids)
                cached = compute(ids, record.cache_salt, record.lora)
                tokens = self.pin(ids, record.cache_salt, record.lora)
            except (ValueError, OSError, RuntimeError) as e:
                problems.append(f"a prefix of {len(ids)} tokens (cache_salt {record.cache_salt!r}): {e}")
                continue
            pinned += tokens
            from_cache += min(cached, tokens)
        for problem in problems:
            logger.warning("pinned prefix not restored: %s", problem)
        if records:
            logger.info(
                "restored %d of %d pinned prefixes from %s: %d tokens, %d of them read from a cache tier",
                len(self._records),
                len(records),
                self._manifest.path,
                pinned,
                from_cache,
            )
        self._write()

    def _write(self) -> None:
        if self._manifest is not None:
            self._manifest.write(list(self._records.values()))
