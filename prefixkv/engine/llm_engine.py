"""The engine loop: admit requests, then per step schedule -> execute -> update -> emit outputs.

The builder (builder.py) makes the parts; the input processor (input_processor.py) admits a
prompt; the scheduler owns the KV cache manager and the request bookkeeping; the model runner owns
the model and sampling. This class owns what the client sees: request groups (request_group*.py),
detokenized outputs and stop conditions (output_processor.py), errors, KV events, stats, pins.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ..cache import KVCacheEvent, KVCacheManager, KVEventBuffer, PrefixCacheStats
from ..engine_args import EngineArgs
from ..lora.request import LoRARequest
from ..model import LoadedModel
from ..outputs import RequestOutput
from ..request import MultiModalItem, RequestStatus
from ..sampling_params import SamplingParams
from .builder import build_engine
from .feature_stats import feature_stats
from .gc_heap import freeze_long_lived_objects, thaw_long_lived_objects
from .input_processor import EngineRequest
from .pending_output import PendingOutput
from .prefix_pins import PrefixPins, computed_by, pin_manifest
from .request_group import arrival_of, make_group
from .request_groups import RequestGroups
from .scheduler_output import SchedulerOutput
from .stats import EngineStats

logger = logging.getLogger("prefixkv")

# nothing to run but slow-tier loads: wait this long for one, then step again (new requests,
# aborts and the server's commands are taken between steps)
TIER_LOAD_NAP_S = 0.01
MAX_PENDING_KV_EVENTS = 10_000  # engine-level buffer for the publisher: beyond it the oldest are dropped


class LLMEngine:
    def __init__(self, config: EngineArgs, loaded: LoadedModel | None = None) -> None:
        thaw_long_lived_objects()  # an engine dropped before is collected with this one's freeze
        self.parts = parts = build_engine(config, loaded)
        self.config = config
        self.device, self.dtype = parts.device, parts.dtype
        self.loaded, self.model_config, self.tokenizer = parts.loaded, parts.loaded.config, parts.tokenizer
        self.default_sampling_params = parts.default_sampling_params
        self.block_tensors, self.num_blocks = parts.block_tensors, parts.num_blocks
        self.max_model_len = parts.max_model_len
        self.scheduler, self.runner, self.lora_manager = parts.scheduler, parts.runner, parts.lora_manager
        self.tiers, self.cpu_threads, self.encoder_cache = parts.tiers, parts.cpu_threads, parts.encoder_cache
        self.stage_outputs = parts.scheduler.stage_outputs
        self.mm_processor, self.input_processor = parts.mm_processor, parts.input_processor
        self.eos_ids = self.input_processor.eos_ids
        self.groups = RequestGroups(
            self.scheduler, self.tokenizer, self.eos_ids, self.max_model_len, config.stream_interval
        )
        self.async_scheduling = parts.async_scheduling
        # a step launched and not yet booked (async scheduling): its schedule, and its pending
        # tokens or the failure of its launch
        self._in_flight: tuple[SchedulerOutput, PendingOutput | Exception] | None = None
        self._seq_ids = itertools.count()  # engine-private sequence ids: never derived from a client's string
        # events leave through a publisher when kv_events_config says so, else wait for take_kv_events()
        self._kv_events = KVEventBuffer(MAX_PENDING_KV_EVENTS)
        self.kv_event_publisher = parts.kv_event_publisher
        # counters for metrics
        self.num_prompt_tokens = 0
        self.num_steps = 0
        self.num_steps_ahead = 0  # steps scheduled before the previous one's tokens were read
        # tokens computed by the last step booked (vllm:iteration_tokens_total): with async
        # scheduling, the step whose outputs the last step() returned, not the one in flight
        self.last_step_num_tokens = 0
        # the inter-token latencies the last step booked (vllm:inter_token_latency_seconds)
        self.last_step_inter_token_latencies: list[float] = []
        self._stats = EngineStats()
        manifest = pin_manifest(config, parts.loaded.source or str(config.model))  # pins kept over restarts
        inputs, kv = self.input_processor, self.kv_cache_manager
        self.pins = PrefixPins(kv, inputs, self.resolve_lora, self._update_stats, manifest)
        self._update_stats()
        self.pins.restore(computed_by(self))
        freeze_long_lived_objects()  # built: what lives as long as the engine leaves the collector's walks

    # -- admission -----------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.input_processor.tokenize(prompt)

    def process_multimodal(
        self, prompt_token_ids: Sequence[int], multi_modal_data: Any
    ) -> tuple[list[int], tuple[MultiModalItem, ...]]:
        """Expand a prompt's image tokens and build its items (input_processor.py)."""
        return self.input_processor.process_multimodal(prompt_token_ids, multi_modal_data)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        prompt_text: str | None = None,
        hidden_states_from: int | None = None,
        priority: int = 0,
        multi_modal_data: Any = None,
    ) -> str:
        """Queue one prompt (text, or token ids that `prompt_text` came from; images as
        `multi_modal_data`, {"image": ...}, one image token per image in the prompt). Returns the
        request id. Atomic: on an exception nothing is registered."""
        req = self.input_processor.process(
            prompt,
            params,
            prompt_text=prompt_text,
            lora_request=lora_request,
            cache_salt=cache_salt,
            priority=priority,
            multi_modal_data=multi_modal_data,
            hidden_states_from=hidden_states_from,
        )
        return self.add_processed(req, request_id=request_id, arrival_time=arrival_time)

    def add_processed(
        self, req: EngineRequest, *, request_id: str | None = None, arrival_time: float | None = None
    ) -> str:
        """Queue a request the input processor admitted; returns the request id. Atomic: the
        adapter, id and arrival time are checked and the sequences built before anything is registered."""
        lora, lora_id = self.resolve_lora(req.lora_request) if req.lora_request is not None else (None, 0)
        request_id = self.groups.new_request_id(request_id)
        arrival = arrival_of(arrival_time)
        grammars = self.input_processor.grammar_engine if req.grammar is not None else None
        group = make_group(
            req,
            lora,
            lora_id,
            request_id,
            arrival,
            self._seq_ids,
            self.tokenizer,
            self.model_config.vocab_size,
            grammars,
            self.stage_outputs is not None,
        )
        # -- commit: nothing below can fail --
        self.groups.add(group)
        self.num_prompt_tokens += len(group.prompt_token_ids) * req.params.n
        self._update_stats()
        return request_id

    def resolve_lora(self, lora_request: LoRARequest, reload: bool = False) -> tuple[LoRARequest, int]:
        """Load (once) and validate the adapter of `lora_request`; returns the request with its
        weights digest filled in (the cache identity) and the engine's adapter id. A loaded
        adapter's folder is not looked at again unless `reload`: then its files are read again and
        new content (by sha256) replaces the old version. ValueError when LoRA is off or the
        adapter cannot be served."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")  # noqa: TRY004
        if self.lora_manager is None:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} requested but LoRA is off: start the engine with "
                "enable_lora=True (--enable-lora)"
            )
        resolved = self.lora_manager.resolve(lora_request, reload)
        if self.lora_manager.retired:  # a reload with new weights retired the old version
            self._evict_retired_loras()
        return resolved

    def remove_lora(self, name: str) -> bool:
        """Forget every adapter version named `name` (vLLM's `remove_lora`, by name). Requests
        already running finish with it; its cached blocks can never be hit again and are evicted
        first (those still held, once their requests end). Returns whether it was known."""
        if self.lora_manager is None:
            return False
        known = self.lora_manager.remove(name)
        self._evict_retired_loras()
        return known

    def _evict_retired_loras(self) -> None:
        """Evict the blocks cached under retired adapter versions; keep the list while running
        requests still hold some, and drop the host copies of versions nobody uses."""
        manager = self.lora_manager
        assert manager is not None
        retired = manager.retired
        _, held = self.kv_cache_manager.evict_where(lambda extras: any(k in retired for k in extras))
        if not held:
            retired.clear()
        in_use = {c.lora_id for g in self.groups.groups.values() for c in g.children if not c.is_finished}
        manager.forget_unused(in_use)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests wherever they are; their blocks are freed at once. Unknown ids are ignored."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self.groups.groups.get(rid)
            if group is not None:
                self.groups.end(group, RequestStatus.FINISHED_ABORTED)
        if self.lora_manager is not None and self.lora_manager.retired:
            self._evict_retired_loras()
        if not self.has_unfinished_requests():
            self._drop_in_flight()
            if self.cpu_threads is not None:
                self.cpu_threads.restore()  # idle after an abort too (a disconnect, an interrupted generate)
        self._update_stats()

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups.groups)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step: schedule -> execute -> update -> emit. Returns an output for every
        request that produced a token (cumulative text and tokens), finished or failed in this
        step. Per-request failures finish that request with `RequestOutput.error`; a failing
        forward pass fails the batch's requests the same way. Neither raises.

        With async_scheduling the next step is scheduled and launched before this one's tokens
        are read (`Scheduler.schedule_ahead`): a GPU computes it while the host books this one.
        The returned outputs are still this step's; one step stays in flight between calls."""
        in_flight, self._in_flight = self._in_flight, None
        outputs: list[RequestOutput] = []
        # what this step books; nothing when it books nothing (a wait for a tier load, a failure)
        self.last_step_num_tokens = 0
        self.last_step_inter_token_latencies = []
        launched_at = None
        if in_flight is None:
            scheduler_output = self.scheduler.schedule()
            if scheduler_output:
                launched_at = time.perf_counter()
                in_flight = (scheduler_output, self._launch(scheduler_output, None))
            elif self.scheduler.num_loading:  # requests wait for slow-tier loads (tiers/): nap until one is done
                self.scheduler.wait_for_tier_loads(TIER_LOAD_NAP_S)
            elif self.scheduler.waiting and not scheduler_output.preempted_req_ids:
                outputs = self.groups.fail_unschedulable()
        if in_flight is not None:
            scheduler_output, launched = in_flight
            if self.async_scheduling and isinstance(launched, PendingOutput):
                ahead = self.scheduler.schedule_ahead(scheduler_output, self.max_model_len)
                if ahead is not None:
                    self.num_steps_ahead += 1
                    self._in_flight = (ahead, self._launch(ahead, launched))
            outputs = self._book(scheduler_output, launched)
            self.last_step_num_tokens = scheduler_output.num_scheduled_tokens
            if launched_at is not None and self._in_flight is None:  # launched and booked in this call
                self.scheduler.record_step(scheduler_output, time.perf_counter() - launched_at)
        if self.lora_manager is not None and self.lora_manager.retired and any(o.finished for o in outputs):
            self._evict_retired_loras()  # held blocks of retired adapters may be free now
        if not self.has_unfinished_requests():
            self._drop_in_flight()  # every request in it has ended: nothing of it is wanted
            if self.cpu_threads is not None:
                self.cpu_threads.restore()  # idle: the caller's torch code gets its own thread count back
        self.drain_kv_events()
        self._update_stats()
        return outputs

    def _launch(self, scheduler_output: SchedulerOutput, previous: PendingOutput | None) -> PendingOutput | Exception:
        """Start a step on the runner; a failure of its forward is returned, to fail its batch when booked."""
        self.num_steps += 1
        if self.cpu_threads is not None:
            self.cpu_threads.before_step(scheduler_output.num_scheduled_tokens)
        try:
            return self.runner.launch(scheduler_output, previous)
        except Exception as e:  # noqa: BLE001 (any failure of the forward fails the batch, not the engine)
            return e

    def _book(self, scheduler_output: SchedulerOutput, launched: PendingOutput | Exception) -> list[RequestOutput]:
        """Read a launched step's tokens (waiting for the device if need be) and book them:
        computed and sampled tokens, detokenized text, stop conditions."""
        try:
            if isinstance(launched, Exception):
                raise launched
            runner_output = launched.result()
        except Exception as e:  # noqa: BLE001 (any failure of the forward fails the batch, not the engine)
            return self.groups.fail_step(scheduler_output, e)
        sampled, failed = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.last_step_inter_token_latencies = self.scheduler.last_inter_token_latencies
        return self.groups.process_outputs(runner_output, sampled, failed)

    def _drop_in_flight(self) -> None:
        """Read and forget the step in flight: its requests have all ended (a stop seen a step
        late, an abort), so it books nothing; afterwards nothing on the device writes their blocks."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            self._book(*in_flight)

    def drain_kv_events(self) -> bool:
        """Hand the waiting KV events to the publisher (one batch per step, as vLLM; never blocks)
        or the buffer. After each step, and from an idle server: True while a tier's writer still
        has saves to make, whose events come later."""
        events = self.scheduler.take_kv_events()
        if events and self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(events)
        elif events:
            self._kv_events.extend(events)
        return self.tiers is not None and self.tiers.writes_pending()

    def take_kv_events(self) -> list[KVCacheEvent]:
        """Every KV event not taken yet, oldest first ([] when a kv_events_config publisher sends them). At most
        MAX_PENDING_KV_EVENTS wait between calls; older ones are dropped and counted in
        `get_stats().num_kv_events_dropped`."""
        self.drain_kv_events()
        return self._kv_events.drain()

    def shutdown(self) -> None:
        """Release what outlives a step: the KV event publisher's thread and sockets (queued batches
        are sent first, for at most a second). The engine serves no request afterwards."""
        publisher, self.kv_event_publisher = self.kv_event_publisher, None
        if publisher is not None:
            publisher.shutdown()

    # -- cache control and statistics ----------------------------------------------------------
    def reset_prefix_cache(self, keep_pinned: bool = False) -> bool:
        ok = self.scheduler.reset_prefix_cache(keep_pinned)
        self.pins.forget_dropped()
        self.drain_kv_events()
        self._update_stats()
        return ok

    def get_stats(self) -> EngineStats:
        """The latest snapshot; safe to call from any thread. The KV tiers' counters are read
        now, not at the last step: their background writers finish saves between and after
        steps (after `tiers.flush()` the counters show every queued save, on an idle engine too)."""
        stats = self._stats
        if self.tiers is not None:
            return replace(stats, kv_tiers=self.tiers.stats())  # each tier's counters under its lock
        return stats

    def _update_stats(self) -> None:
        s = self.scheduler
        cache = s.prefix_cache_stats
        self._stats = EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            kv_cache_usage=s.kv_cache_usage,
            prefix_cache_requests=cache.requests,
            prefix_cache_queries=cache.queries,
            prefix_cache_hits=cache.hits,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.groups.num_generation_tokens,
            num_preemptions=s.num_preemptions,
            num_requests_errored=self.groups.num_requests_errored,
            num_kv_events_dropped=self._kv_events.num_dropped
            + s.num_dropped_kv_events
            + (self.kv_event_publisher.num_dropped_events if self.kv_event_publisher is not None else 0),
            num_blocks=self.num_blocks,
            num_steps_ahead=self.num_steps_ahead,
            block_size=self.config.block_size,
            max_model_len=self.max_model_len,
            **feature_stats(self.parts),
        )

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        return self.scheduler.kv_cache_manager

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.scheduler.prefix_cache_stats

    @property
    def kv_cache_usage(self) -> float:
        return self.scheduler.kv_cache_usage
