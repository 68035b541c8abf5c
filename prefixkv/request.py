"""A generation request: its tokens, where it stands, and what sets its cache identity apart."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence
from typing import Any

from .lora.request import LoRARequest
from .multimodal.item import MultiModalItem


def _as_mm_item(item: Any) -> MultiModalItem:
    """Accept a MultiModalItem, an (identifier, offset, length) tuple or a dict naming them."""
    if isinstance(item, MultiModalItem):
        return item
    if isinstance(item, dict):
        ident = item.get("identifier", item.get("mm_hash", item.get("hash")))
        offset = item.get("offset", item.get("start"))
        if ident is None or offset is None or "length" not in item:
            raise ValueError(f"a multimodal item needs identifier, offset and length: {item!r}")
        return MultiModalItem(str(ident), int(offset), int(item["length"]))
    if isinstance(item, (tuple, list)) and len(item) == 3:
        return MultiModalItem(str(item[0]), int(item[1]), int(item[2]))
    raise ValueError(f"cannot read a multimodal item from {item!r}")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # waiting for its prefix's KV from a slow tier (prefixkv/tiers), holding no block (vLLM's name)
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # failed alone (e.g. in sampling); reported as finish_reason "abort"

    @property
    def is_finished(self) -> bool:
        return self in FINISHED_STATUSES


FINISHED_STATUSES = frozenset(
    (
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    )
)


class Request:
    """Satisfies prefixkv.cache.CacheRequest. Token lists only grow; the cache manager extends
    the request's block identities incrementally from `all_token_ids`.

    In the engine `request_id` is engine-private and unique by construction (the scheduler and
    the cache manager key by it); the client's id belongs to the request group."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        sampling_params: Any = None,
        lora_request: LoRARequest | str | None = None,
        mm_items: Iterable[MultiModalItem | tuple | dict] = (),
        cache_salt: str | None = None,
        prompt: str | None = None,
        arrival_time: float | None = None,
        generator: Any = None,
        priority: int = 0,
        cache_priority: int | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self._all_token_ids = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.sampling_params = sampling_params
        if isinstance(lora_request, str):
            lora_request = LoRARequest(lora_request)
        self.lora_request = lora_request
        self.lora_id = 0  # the engine's id of the loaded adapter (prefixkv.lora.LoRAManager), 0: base
        self.mm_items = tuple(_as_mm_item(item) for item in mm_items)
        for item in self.mm_items:
            if item.offset < 0 or item.length < 1 or item.offset + item.length > len(self.prompt_token_ids):
                raise ValueError(f"request {request_id!r}: multimodal item {item} lies outside the prompt")
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority  # --scheduling-policy priority: lower goes first (vLLM)
        # --eviction-policy priority: a lower value's blocks are evicted last (the request's
        # `priority` unless it asked for another)
        self.cache_priority = priority if cache_priority is None else cache_priority
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None  # when its latest token was booked
        self.finished_time: float | None = None
        self.num_cached_tokens = -1  # prompt tokens served from the cache at first admission
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # Prompt logprobs need logits at every prompt position, so such a request computes its
        # whole prompt (it still caches its blocks for others).
        self.skip_prefix_cache_read = False
        # Prompt tokens whose logprob is known (token 0 has none); read while skip_prefix_cache_read.
        self.prompt_logprobs_upto = 1
        # With the stage-output cache: cache hits must have valid cached outputs, and their hidden
        # states are read back for the prompt positions this request still needs.
        self.reads_stage_outputs = False
        # Prompt positions whose final hidden state has been delivered (None: none are wanted).
        self.prompt_hidden_upto: int | None = None
        self.generator = generator  # seeded torch.Generator, or None for the engine's default
        self.error: str | None = None  # why the request failed, when status is FINISHED_ERROR
        # logit_bias / allowed_token_ids / bad_words / grammar (prefixkv.constraints.RequestConstraints)
        self.constraints: Any = None

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        if isinstance(token_ids, int):  # one a step: every request, every step
            self.output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
            return
        for tok in token_ids:
            self.output_token_ids.append(tok)
            self._all_token_ids.append(tok)

    def discard_output_tokens(self, n: int) -> None:
        """Drop the last `n` output tokens: those a step gained after the one its sequence stopped
        on (speculative decoding), before the request is finished. Only then: the cache keys
        blocks from `all_token_ids` when steps are scheduled, never between a step's booking
        and its outputs' processing, so no block identity has read them."""
        if n > 0:
            del self.output_token_ids[-n:]
            del self._all_token_ids[-n:]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.value})"
        )
