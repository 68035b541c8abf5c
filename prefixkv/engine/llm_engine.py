"""The engine loop: admit requests, then per step schedule -> execute -> update -> emit outputs.

The builder (builder.py) makes the parts; the input processor (input_processor.py) admits a
prompt; the scheduler owns the KV cache manager and the request bookkeeping; the model runner owns
the model and sampling. This class owns what the client sees: request groups (request_group.py),
detokenized outputs and stop conditions (output_processor.py), errors, KV events and the stats
snapshot.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ..cache import KVCacheEvent, KVCacheManager, KVEventBuffer, PrefixCacheStats
from ..engine_args import EngineArgs
from ..lora.request import LoRARequest
from ..model import LoadedModel
from ..outputs import RequestOutput
from ..request import MultiModalItem, Request, RequestStatus
from ..sampling_params import SamplingParams
from .builder import build_engine
from .feature_stats import feature_stats
from .input_processor import EngineRequest, InputProcessor
from .model_runner_output import ModelRunnerOutput
from .output_processor import logprob_entry, status_for
from .request_group import RequestGroup, make_group
from .scheduler_output import SchedulerOutput
from .stats import EngineStats

logger = logging.getLogger("prefixkv")

# nothing to run but slow-tier loads: wait this long for one, then step again (new requests,
# aborts and the server's commands are taken between steps)
TIER_LOAD_NAP_S = 0.01
MAX_PENDING_KV_EVENTS = 10_000  # engine-level buffer for the publisher: beyond it the oldest are dropped


class LLMEngine:
    def __init__(self, config: EngineArgs, loaded: LoadedModel | None = None) -> None:
        self.parts = parts = build_engine(config, loaded)
        self.config = config
        self.device, self.dtype = parts.device, parts.dtype
        self.loaded, self.model_config, self.tokenizer = parts.loaded, parts.loaded.config, parts.tokenizer
        self.default_sampling_params = parts.default_sampling_params
        self.block_tensors, self.num_blocks, self.max_model_len = (
            parts.block_tensors,
            parts.num_blocks,
            parts.max_model_len,
        )
        self.scheduler, self.runner, self.lora_manager = parts.scheduler, parts.runner, parts.lora_manager
        self.tiers, self.cpu_threads, self.encoder_cache = parts.tiers, parts.cpu_threads, parts.encoder_cache
        self.stage_outputs = parts.scheduler.stage_outputs
        self.mm_processor = parts.mm_processor
        self.input_processor = InputProcessor(
            config, self.tokenizer, self.model_config, self.max_model_len, self.mm_processor
        )
        self.eos_ids = self.input_processor.eos_ids
        self._groups: dict[str, RequestGroup] = {}
        self._child_of: dict[str, tuple[RequestGroup, int]] = {}  # engine-private sequence id -> (group, index)
        self._group_ids = itertools.count()  # ids for requests that bring none
        self._seq_ids = itertools.count()  # engine-private sequence ids: never derived from a client's string
        # events leave the process through a publisher when kv_events_config says so (kv_events/);
        # otherwise they wait in _kv_events for take_kv_events()
        self._kv_events = KVEventBuffer(MAX_PENDING_KV_EVENTS)
        self.kv_event_publisher = parts.kv_event_publisher
        # counters for metrics
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_requests_errored = 0
        self.num_steps = 0
        self.last_step_num_tokens = 0  # tokens computed by the last step (vllm:iteration_tokens_total)
        self._stats = EngineStats()
        self._update_stats()

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
        if request_id is None:
            request_id = str(next(self._group_ids))
            while request_id in self._groups:  # a client may have taken it
                request_id = str(next(self._group_ids))
        elif not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        elif request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if arrival_time is None:
            arrival = time.time()
        elif isinstance(arrival_time, (int, float)) and math.isfinite(arrival_time):
            arrival = float(arrival_time)
        else:
            raise ValueError(f"arrival_time must be a finite number, got {arrival_time!r}")
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
        self._groups[request_id] = group
        for i, child in enumerate(group.children):
            self._child_of[child.request_id] = (group, i)
            self.scheduler.add_request(child)
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
        in_use = {c.lora_id for g in self._groups.values() for c in g.children if not c.is_finished}
        manager.forget_unused(in_use)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests wherever they are; their blocks are freed at once. Unknown ids are ignored."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self._groups.get(rid)
            if group is not None:
                self._end_group(group, RequestStatus.FINISHED_ABORTED)
        if self.lora_manager is not None and self.lora_manager.retired:
            self._evict_retired_loras()
        if self.cpu_threads is not None and not self.has_unfinished_requests():
            self.cpu_threads.restore()  # idle after an abort too (a disconnect, an interrupted generate)
        self._update_stats()

    def _end_group(self, group: RequestGroup, status: RequestStatus) -> None:
        """Finish every unfinished sequence of a group with `status` and forget the group."""
        for child, state in zip(group.children, group.states):
            if not child.is_finished:
                state.abort()
                self.scheduler.finish_request(child, status)
        self._forget(group)

    def _forget(self, group: RequestGroup) -> None:
        self._groups.pop(group.request_id, None)
        for child in group.children:
            self._child_of.pop(child.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step: schedule -> execute -> update -> emit. Returns an output for every
        request that produced a token (cumulative text and tokens), finished or failed in this
        step. Per-request failures finish that request with `RequestOutput.error`; a failing
        forward pass fails the batch's requests the same way. Neither raises."""
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output:
            if self.scheduler.num_loading:  # requests wait for slow-tier loads (tiers/): nap until one is done
                self.scheduler.wait_for_tier_loads(TIER_LOAD_NAP_S)
                outputs = []
            else:
                stuck = self.scheduler.waiting and not scheduler_output.preempted_req_ids
                outputs = self._fail_unschedulable() if stuck else []
        else:
            self.num_steps += 1
            self.last_step_num_tokens = scheduler_output.num_scheduled_tokens
            if self.cpu_threads is not None:
                self.cpu_threads.before_step(scheduler_output.num_scheduled_tokens)
            try:
                runner_output = self.runner.execute(scheduler_output)
            except Exception as e:  # noqa: BLE001 (any failure of the forward fails the batch, not the engine)
                outputs = self._fail_step(scheduler_output, e)
            else:
                sampled, failed = self.scheduler.update_from_output(scheduler_output, runner_output)
                outputs = self._process_outputs(runner_output, sampled, failed)
        if self.lora_manager is not None and self.lora_manager.retired and any(o.finished for o in outputs):
            self._evict_retired_loras()  # held blocks of retired adapters may be free now
        if self.cpu_threads is not None and not self.has_unfinished_requests():
            self.cpu_threads.restore()  # idle: the caller's torch code gets its own thread count back
        self._drain_kv_events()
        self._update_stats()
        return outputs

    def _process_outputs(
        self, runner_output: ModelRunnerOutput, sampled: list[Request], failed: list[Request]
    ) -> list[RequestOutput]:
        """The output processor's half of the step: prompt logprobs, detokenized text, stop
        conditions (a stopped sequence is finished in the scheduler), failed groups."""
        for req_id, scored in runner_output.prompt_logprobs.items():
            group = self._child_of[req_id][0]
            entries = group.prompt_logprobs
            if entries is None:  # only groups that asked are scored
                continue
            prompt = group.prompt_token_ids
            for pos, p_lp, p_rank, p_top in zip(
                itertools.count(scored.first), scored.logprobs, scored.ranks, scored.top
            ):
                entries.append(logprob_entry(self.tokenizer, prompt[pos], p_lp, p_rank, p_top))
        for req_id, (_, rows) in runner_output.hidden_states.items():
            hidden = self._child_of[req_id][0].hidden_states
            if hidden is not None:
                hidden.append(rows)
        touched: dict[str, RequestGroup] = {}
        now = time.time()
        lps, tops, ranks = runner_output.logprobs, runner_output.top_logprobs, runner_output.ranks
        for row, req in enumerate(sampled):
            self.num_generation_tokens += 1
            group, idx = self._child_of[req.request_id]
            touched[group.request_id] = group
            token = runner_output.sampled_token_ids[row]
            lp: float | None = None
            top: list[tuple[int, float]] | None = None
            rank: int | None = None
            if lps is not None and tops is not None and ranks is not None and req.sampling_params.logprobs is not None:
                lp, top, rank = lps[row], tops[row], ranks[row]
            try:
                done = group.states[idx].update(req, token, self.eos_ids, self.max_model_len, lp, top, rank)
            except Exception as e:  # noqa: BLE001 (e.g. detokenizing: this request fails alone)
                req.error = f"processing the output failed: {type(e).__name__}: {e}"
                failed.append(req)
                continue
            if done:
                req.finished_time = now
                self.scheduler.finish_request(req, status_for(group.states[idx].finish_reason or "stop"))
        for req in failed:
            entry = self._child_of.get(req.request_id)
            if entry is not None:
                self._fail_group(entry[0], req.error or "the request failed")
                touched[entry[0].request_id] = entry[0]
        outputs = []
        for group in touched.values():
            out = group.output()
            outputs.append(out)
            if out.finished:
                self._forget(group)
        return outputs

    def _fail_group(self, group: RequestGroup, message: str) -> None:
        if group.error is None:
            group.error = message
            self.num_requests_errored += 1
            logger.warning("request %s failed: %s", group.request_id, message)
        for child, state in zip(group.children, group.states):
            if child.request_id in self.scheduler.requests:
                self.scheduler.finish_request(child, RequestStatus.FINISHED_ERROR)
            if child.status is RequestStatus.FINISHED_ERROR or state.finish_reason is None:
                state.abort()

    def _fail_step(self, scheduler_output: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """The forward pass failed: the batch's new blocks were entered in the cache table but
        hold no valid KV. Fail the batch's requests and forget every cached identity so no later
        request hits them; if other requests hold blocks the table cannot be reset under them,
        so they fail too. The engine keeps serving."""
        logger.exception("the model failed in a step of %d requests", len(scheduler_output.scheduled))
        message = f"the model failed: {type(exc).__name__}: {exc}"
        groups = self._groups_of([sr.req_id for sr in scheduler_output.scheduled])
        for group in groups:
            self._fail_group(group, message)
        if not self.scheduler.reset_prefix_cache():
            others = self._groups_of([r.request_id for r in self.scheduler.running])
            for group in others:
                self._fail_group(group, message)
            groups += others
            self.scheduler.reset_prefix_cache()
        outputs = [g.output() for g in groups]
        for group in groups:
            self._forget(group)
        return outputs

    def _fail_unschedulable(self) -> list[RequestOutput]:
        """Nothing could be scheduled although requests wait (a request that can never fit):
        fail the head of the queue rather than spin."""
        head = self.scheduler.waiting[0]
        group = self._child_of[head.request_id][0]
        self._fail_group(group, "the request cannot be scheduled: it does not fit in the KV cache")
        out = group.output()
        self._forget(group)
        return [out]

    def _groups_of(self, req_ids: list[str]) -> list[RequestGroup]:
        seen: dict[str, RequestGroup] = {}
        for rid in req_ids:
            entry = self._child_of.get(rid)
            if entry is not None:
                seen.setdefault(entry[0].request_id, entry[0])
        return list(seen.values())

    # -- KV events -----------------------------------------------------------------------------
    def _drain_kv_events(self) -> None:
        events = self.scheduler.take_kv_events()
        if events:
            if self.kv_event_publisher is not None:  # one batch per step, as vLLM; never blocks
                self.kv_event_publisher.publish(events)
                return
            buffer = self._kv_events
            for event in events:
                buffer.append(event)

    def take_kv_events(self) -> list[KVCacheEvent]:
        """Every KV event not taken yet, oldest first ([] when a kv_events_config publisher sends them). At most
        MAX_PENDING_KV_EVENTS wait between calls; older ones are dropped and counted in
        `get_stats().num_kv_events_dropped`."""
        self._drain_kv_events()
        return self._kv_events.drain()

    def shutdown(self) -> None:
        """Release what outlives a step: the KV event publisher's thread and sockets (queued batches
        are sent first, for at most a second). The engine serves no request afterwards."""
        publisher, self.kv_event_publisher = self.kv_event_publisher, None
        if publisher is not None:
            publisher.shutdown()

    # -- cache control and statistics ----------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        ok = self.scheduler.reset_prefix_cache()
        self._drain_kv_events()
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
            num_generation_tokens=self.num_generation_tokens,
            num_preemptions=s.num_preemptions,
            num_requests_errored=self.num_requests_errored,
            num_kv_events_dropped=self._kv_events.num_dropped
            + s.num_dropped_kv_events
            + (self.kv_event_publisher.num_dropped_events if self.kv_event_publisher is not None else 0),
            num_blocks=self.num_blocks,
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
