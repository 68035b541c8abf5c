"""Continuous batching with a token budget, chunked prefill, prefix-cache lookup and
preemption by recompute; first come first served, or by `priority` (lower first, then arrival) with
scheduling_policy="priority", as vLLM.

The scheduler owns the KV cache manager (as in vLLM v1 and nano-vllm): it alone allocates and
frees blocks and writes `Request.num_computed_tokens`. Each step it hands the model runner a
`SchedulerOutput` and takes the `ModelRunnerOutput` back in `update_from_output`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from ..cache import KVCacheBlock, KVCacheEvent, KVCacheManager, PrefixCacheStats, ResidencyMetrics
from ..memory.block_tensors import BlockTensors
from ..multimodal.encoder_input import EncoderInput
from ..request import Request, RequestStatus
from ..speculative import DraftBudget, Drafter, SpecDecodeStats
from ..stage_outputs import StageOutputCache
from ..tiers import NULL_SCHEDULER_CONNECTOR, SchedulerConnector
from .model_runner_output import ModelRunnerOutput
from .scheduler_output import ScheduledRequest, SchedulerOutput


class Scheduler:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_caching: bool = True,
        hash_algo: Any = "sha256_cbor",
        eviction_policy: Any = "lru",
        enable_kv_cache_events: bool = False,
        max_pinned_fraction: float = 0.5,
        residency: ResidencyMetrics | None = None,
        max_loras: int | None = None,
        policy: str = "fcfs",
        kv_connector: SchedulerConnector = NULL_SCHEDULER_CONNECTOR,
        stage_output_tensors: BlockTensors | None = None,
        kv_group_windows: Sequence[int | None] = (),
        kv_group_kind: str = "full_attention",
        drafter: Drafter | None = None,
        draft_budget: DraftBudget | None = None,
    ) -> None:
        """`kv_connector`: the scheduler half of the KV tiers (prefixkv/tiers); the null one
        without tiers. `stage_output_tensors`: the block tensors holding the stage outputs, when
        the stage-output cache is on; its validity follows this scheduler's block pool.
        `kv_group_windows`: a hybrid model's KV-cache groups after the first (their windows,
        None: full attention; cache/sliding_window.py); `kv_group_kind`: what group 0's blocks hold
        ("full_attention", or "mamba" for a recurrent model's state), as KV events name it.
        `drafter`: speculative decoding's (prefixkv/speculative), None: off; `draft_budget`: how
        many of its drafts a request gets (all: None)."""
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}; choose fcfs or priority")
        self.policy = policy
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.kv_cache_manager = KVCacheManager(
            num_blocks=num_blocks,
            block_size=block_size,
            enable_caching=enable_caching,
            hash_algo=hash_algo,
            hash_seed=None,
            eviction_policy=eviction_policy,
            enable_kv_cache_events=enable_kv_cache_events,
            max_pinned_fraction=max_pinned_fraction,
            residency=residency,
            group_windows=kv_group_windows,
            group_kind=kv_group_kind,
        )
        self.block_size = block_size
        self.num_kv_groups = 1 + len(kv_group_windows)  # a block position takes a block in each
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Most distinct LoRA adapters among running requests (None: LoRA off); a request whose
        # adapter would exceed it waits; base-model requests behind it may go first, requests of
        # any adapter behind it wait too (so a resident adapter's requests drain and a slot frees).
        self.max_loras = max_loras
        self.requests: dict[str, Request] = {}  # every unfinished request, by its engine-private id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # preempted by schedule_ahead while their last step was in flight: that step's booking
        # counts no computed tokens for them (their blocks are gone) but books their token
        self._preempted_in_flight: set[str] = set()
        # a request that would read stage-output rows its own step loads from a tier waits for a
        # step in order (schedule_ahead)
        self._reader_waiting = False
        self._finished_ids: list[str] = []  # left since the last schedule()
        # the last booked step's inter-token latencies: for each sequence that got a token and had
        # one before, the seconds between the two bookings (vLLM's inter_token_latency)
        self.last_inter_token_latencies: list[float] = []
        self.stage_outputs: StageOutputCache | None = None
        if stage_output_tensors is not None:
            blocks = self.kv_cache_manager.block_pool.blocks
            self.stage_outputs = StageOutputCache(stage_output_tensors, blocks, block_size)
        self.kv_connector = kv_connector
        self.drafter = drafter
        self.draft_budget = draft_budget
        self.spec_stats = SpecDecodeStats(drafter.k if drafter is not None else 0)

    # -- requests in and out -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:  # ids are engine-private: this is a bug, not input
            raise RuntimeError(f"request id {request.request_id!r} is already scheduled")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        if self.policy == "priority":
            self._insert_by_priority(request)
        else:
            self.waiting.append(request)

    @staticmethod
    def _priority_key(req: Request) -> tuple[int, float]:
        return req.priority, req.arrival_time

    def _insert_by_priority(self, req: Request) -> None:
        """Keep `waiting` sorted by (priority, arrival), ties in insertion order. Scanned from the
        back: most requests share a priority and land at the end at once."""
        key = self._priority_key(req)
        i = len(self.waiting)
        while i > 0 and self._priority_key(self.waiting[i - 1]) > key:
            i -= 1
        self.waiting.insert(i, req)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Remove a request (finished, aborted or failed) wherever it is and release its blocks."""
        if self.requests.pop(req.request_id, None) is None:
            return
        self.kv_connector.request_finished(req.request_id)
        self._preempted_in_flight.discard(req.request_id)
        req.status = status
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv_cache_manager.free(req)
        if self.drafter is not None:
            self.drafter.forget(req.request_id)
            if self.draft_budget is not None:
                self.draft_budget.forget(req.request_id)
        self._finished_ids.append(req.request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = []
        kv = self.kv_cache_manager
        connector = self.kv_connector
        budget = self.max_num_batched_tokens
        now = time.time()

        # Running requests first, oldest first; when blocks run out, the newest is preempted (with
        # the priority policy: the one of largest (priority, arrival) among those not yet
        # scheduled in this step - vLLM also looks at those already scheduled and undoes their
        # step; here that case falls back to the request itself, which keeps preemption cheap).
        drafter = self.drafter
        if drafter is not None and drafter.off_above is not None and len(self.running) > drafter.off_above:
            drafter = None
        if drafter is not None and self.draft_budget is not None:
            self.draft_budget.start_step(len(self.running))
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if drafter is not None and num_new == 1 and budget > 1:
                drafts = self._drafts(drafter, req, budget - 1)
                # room for the drafts too, or none: drafts never preempt anyone
                if drafts and kv.allocate_slots(req, 1 + len(drafts)) is not None:
                    sr = self._scheduled(req, 1)
                    sr.token_ids.extend(drafts)
                    sr.draft_token_ids = drafts
                    out.scheduled.append(sr)
                    out.num_draft_tokens += len(drafts)
                    budget -= 1 + len(drafts)
                    i += 1
                    continue
            while kv.allocate_slots(req, num_new) is None:
                if self.policy == "priority":
                    victim = max(self.running[i:], key=self._priority_key)
                    self.running.remove(victim)
                else:
                    victim = self.running.pop()
                self._preempt(victim)
                out.preempted_req_ids.append(victim.request_id)
                if victim is req:
                    break
            else:
                out.scheduled.append(self._scheduled(req, num_new))
                budget -= num_new
                i += 1

        # Then waiting ones, in arrival order, unless this step had to preempt.
        if not out.preempted_req_ids:
            budget = self._admit_waiting(out, budget, now)
        out.num_scheduled_tokens = self.max_num_batched_tokens - budget
        connector.plan(out, self.requests, kv)
        return out

    def _drafts(self, drafter: Drafter, req: Request, room: int) -> list[int]:
        """Draft tokens for a decoding request, as many as fit its max_tokens, the model's length
        and `room`; none where sampling reads what drafts would change (a grammar's state), or
        where the hidden states of generated positions are returned."""
        params = req.sampling_params
        if req.constraints is not None or params.return_hidden_states:
            return []
        room = min(room, drafter.max_model_len - req.num_tokens - 1)
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - req.num_output_tokens - 1)
        drafts = drafter.propose(req.request_id, req.all_token_ids, room)
        if drafts and self.draft_budget is not None:
            del drafts[self.draft_budget.length(req.request_id, len(drafts)) :]
        return drafts

    def record_step(self, step: SchedulerOutput, seconds: float) -> None:
        """The engine timed a booked step (launch to booking): one of decodes alone - drafts
        included, no prompt chunk - tells the draft budget what its rows cost."""
        if self.draft_budget is not None and step.num_scheduled_tokens == len(step.scheduled) + step.num_draft_tokens:
            self.draft_budget.record_step(step.num_scheduled_tokens, seconds)

    def schedule_ahead(self, in_flight: SchedulerOutput, max_model_len: int) -> SchedulerOutput | None:
        """The step after `in_flight`, scheduled before its tokens are known (vLLM's async
        scheduling): every request it samples for computes, next, the token being sampled now,
        read by the runner from that step's draws. None when the next step needs what only the
        tokens or the ordinary `schedule()` can give: a running request the step left out, a
        request reading stage outputs loaded from the tiers (below). A prompt in chunks goes on
        with its next chunk (its tokens are known), given the budget in the running order as
        `schedule()` gives it; waiting requests are admitted behind as `schedule()` admits them
        (their prompts are known), unless the step had to preempt. When the blocks run out, the
        newest request going on (with the priority policy: the one of largest (priority,
        arrival)) is preempted, as `schedule()` would after the booking: its blocks are freed now
        (the step in flight writes them before anything launched later can), and that step's
        booking still gives it its token, so it recomputes the same tokens as in order
        (`_preempted_in_flight`).

        A request that the count of its tokens ends after `in_flight` (max_tokens, the model's
        length) is left out; one that stops on a token (EOS, a stop string) is seen a step late,
        and the token computed for it then is dropped (update_from_output skips ended requests).

        Stage-output rows are written when a step is booked and made readable then (stage_outputs/
        store.py): a request admitted ahead reads those of its hits, which were (a hit whose rows
        the step in flight is writing waits for its booking, `_admit_waiting`). One that would read
        rows loaded from the tiers in its own step - put in at that step's booking - is not
        admitted ahead, nothing behind it either, and the next step is None."""
        if in_flight.num_draft_tokens:  # how many tokens it gains is known when it is booked
            return None
        stepping = {sr.req_id for sr in in_flight.scheduled}
        if any(r.request_id not in stepping for r in self.running):
            return None
        if self._reader_waiting:  # admitted in order, its loads' rows put in at launch
            self._reader_waiting = False
            return None
        kv = self.kv_cache_manager
        requests = self.requests
        bs = self.block_size
        budget = self.max_num_batched_tokens
        # with the blocks each holds, and the tokens of its next chunk (0: a decode)
        going_on: list[tuple[Request, ScheduledRequest, int, int]] = []
        num_new_blocks = 0
        for sr in in_flight.scheduled:
            req = requests.get(sr.req_id)
            if req is None:  # ended since it was launched
                continue
            if not sr.sample:
                # a prompt in chunks: its next chunk is known, and takes the budget as schedule()
                # gives it, in the running order
                end = sr.start + len(sr.token_ids)
                num_new = min(req.num_tokens - end, budget)
                if num_new <= 0:
                    return None
                budget -= num_new
                held = kv.num_blocks_held(sr.req_id)
                going_on.append((req, sr, held, num_new))
                num_new_blocks += max(0, -(-(end + num_new) // bs) - held)
                continue
            params = req.sampling_params
            num_tokens = req.num_tokens
            if (params.max_tokens is not None and req.num_output_tokens + 1 >= params.max_tokens) or (
                num_tokens + 1 >= max_model_len
            ):
                continue  # its last token is the one being sampled
            budget -= 1
            if budget < 0:
                return None
            held = kv.num_blocks_held(sr.req_id)
            going_on.append((req, sr, held, 0))
            num_new_blocks += max(0, -(-(num_tokens + 1) // bs) - held)
        # a sliding group's releases, which come first, are not counted: the count errs high
        preempted: list[str] = []
        while going_on and num_new_blocks * self.num_kv_groups > kv.num_free_blocks:
            at = len(going_on) - 1  # the newest: going_on is in the running order
            if self.policy == "priority":
                at = max(range(len(going_on)), key=lambda i: self._priority_key(going_on[i][0]))
            victim, sr, held, num_new = going_on.pop(at)
            end = sr.start + len(sr.token_ids) + num_new if num_new else victim.num_tokens + 1
            num_new_blocks -= max(0, -(-end // bs) - held)
            budget += num_new or 1
            self.running.remove(victim)
            self._preempt(victim)
            self._preempted_in_flight.add(victim.request_id)
            preempted.append(victim.request_id)
        if not going_on:
            return None
        out = SchedulerOutput(finished_req_ids=self._finished_ids, preempted_req_ids=preempted)
        self._finished_ids = []
        scheduled = out.scheduled
        for req, sr, held, num_new in going_on:
            if num_new:
                end = sr.start + len(sr.token_ids)
                taken = kv.allocate_slots(req, end + num_new - req.num_computed_tokens)
                assert taken is not None, "blocks were counted above"
                scheduled.append(self._scheduled(req, num_new, end))
                continue
            # room for the token being sampled: its position is the request's current length
            start = req.num_tokens
            new_blocks = kv.allocate_slots(req, start - req.num_computed_tokens + 1)
            assert new_blocks is not None, "blocks were counted above"
            block_eos = req.num_output_tokens + 1 < req.sampling_params.min_tokens
            # The in-flight step's table was read after its own allocation; unless this one took a
            # block it is still the request's (shared, never edited: the manager hands out copies)
            table = sr.block_table
            if new_blocks or len(table) != held:
                table = kv.get_block_ids(sr.req_id)
            # a hybrid's later groups: the manager's lists, new only where a block came or left
            groups = kv.get_group_block_ids(sr.req_id) if sr.group_block_tables else sr.group_block_tables
            scheduled.append(sr.next_decode(start, table, block_eos, req.prompt_logprobs_upto, groups))
        if not preempted:
            budget = self._admit_waiting(out, budget, time.time(), ahead=True)
        out.num_scheduled_tokens = self.max_num_batched_tokens - budget
        self.kv_connector.plan(out, self.requests, kv)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int, now: float, ahead: bool = False) -> int:
        """Admit waiting requests into `out` in arrival order (priority order with that policy), each
        looked up in the prefix cache, until the token budget, the sequence limit or the blocks run
        out (nothing is preempted for them); returns the budget left."""
        kv = self.kv_cache_manager
        connector = self.kv_connector
        loras = {r.lora_id for r in self.running if r.lora_id} if self.max_loras else None
        skipped: list[Request] = []  # waiting for an adapter slot: back at the front afterwards
        # An older request waits for an adapter slot: newer requests of the resident adapters are
        # not admitted either, or a steady stream of them would hold the slots forever (a request
        # for another adapter waited > 45 s behind 38 newer ones of the resident adapter).
        lora_blocked = False
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS and not connector.load_ready(req.request_id):
                skipped.append(self.waiting.popleft())  # its tier load is in flight: the others go on
                continue
            if loras is not None and req.lora_id:
                if req.lora_id not in loras and len(loras) >= self.max_loras:  # type: ignore[operator]
                    lora_blocked = True
                    skipped.append(self.waiting.popleft())
                    continue
                if lora_blocked:  # newer than a request waiting for a slot: behind it
                    skipped.append(self.waiting.popleft())
                    continue
            hits: list[KVCacheBlock]
            if req.skip_prefix_cache_read:
                hits, num_hit = [], 0
            else:
                hits, num_hit = kv.get_computed_blocks(req, record_stats=False)
                if req.reads_stage_outputs and hits and self.stage_outputs is not None:
                    valid = self.stage_outputs.num_valid_prefix(hits)
                    if valid < len(hits):
                        if hits[valid].ref_cnt > 0:
                            # a request holds it, likely computing it in this very step: wait one
                            # step for its outputs rather than recompute them (FCFS: nothing behind
                            # it goes first)
                            break
                        # nobody holds it, so nothing will write its rows: recompute from there
                        # (waiting would stall the queue for good)
                        hits, num_hit = hits[:valid], valid * self.block_size
            num_loaded_blocks = connector.match(req, len(hits), kv)  # blocks after the hits, from the tiers
            if num_loaded_blocks is None:  # a slow-tier load just started for it: it waits holding no block
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                skipped.append(self.waiting.popleft())
                continue
            if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS and not connector.is_loading(req.request_id):
                req.status = RequestStatus.WAITING  # back from its load, or the load is no longer needed
            if ahead and num_loaded_blocks and self._may_read_stage_outputs(req):
                # it would read rows its loads put in when the step in flight has been booked
                self._reader_waiting = True
                break
            num_loaded = num_loaded_blocks * self.block_size
            num_new = min(req.num_tokens - num_hit - num_loaded, budget)
            if kv.allocate_slots(req, num_loaded + num_new, hits) is None:
                break  # FCFS: nothing behind it jumps the queue
            self.waiting.popleft()
            if kv.enable_caching and not req.skip_prefix_cache_read:
                kv.stats.record(req.num_tokens, num_hit, preempted=req.num_preemptions > 0)
            connector.admitted(req, len(hits), kv)
            num_hit += num_loaded
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                req.first_scheduled_time = now
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(self._scheduled(req, num_new))
            budget -= num_new
            if loras is not None and req.lora_id:
                loras.add(req.lora_id)
        self.waiting.extendleft(reversed(skipped))
        return budget

    # -- KV tiers (prefixkv/tiers), through the connector -------------------------------------
    @property
    def num_loading(self) -> int:
        """Requests waiting for a slow-tier load (none can be scheduled until it completes)."""
        return self.kv_connector.num_loading

    def wait_for_tier_loads(self, timeout_s: float) -> None:
        """Nothing else to run: sleep until a tier load completes, at most `timeout_s`."""
        self.kv_connector.wait_for_loads(timeout_s)

    def _scheduled(self, req: Request, num_new: int, start: int | None = None) -> ScheduledRequest:
        """The request's next `num_new` tokens from `start` (default: its computed tokens; a chunk
        scheduled ahead starts where the chunk in flight ends)."""
        if start is None:
            start = req.num_computed_tokens
        params = req.sampling_params
        n_prompt = req.num_prompt_tokens
        want_logprobs = req.prompt_logprobs_upto < n_prompt and (
            req.skip_prefix_cache_read or (req.reads_stage_outputs and params.prompt_logprobs is not None)
        )
        hidden_upto = req.prompt_hidden_upto
        # prompt positions; with return_hidden_states, generated ones too
        want_hidden = hidden_upto is not None and (hidden_upto < n_prompt or params.return_hidden_states)
        reads: tuple[int, ...] = ()
        # (a chunk scheduled ahead reads none: the chunk in flight computes the rows before it)
        if req.reads_stage_outputs and start and (want_logprobs or want_hidden) and start == req.num_computed_tokens:
            # cache hits hold positions this request still needs: their cached outputs are read back
            need = start  # the first position whose outputs it still needs (start: none before it)
            if want_logprobs:  # position p's hidden state scores prompt token p + 1
                need = min(need, req.prompt_logprobs_upto - 1)
            if want_hidden and hidden_upto is not None:  # past the prompt with return_hidden_states
                need = min(need, hidden_upto)
            bs = self.block_size
            if need < start and start % bs == 0:
                reads = tuple(self.kv_cache_manager.get_block_ids(req.request_id)[need // bs : start // bs])
        return ScheduledRequest(
            req_id=req.request_id,
            token_ids=req.all_token_ids[start : start + num_new],
            start=start,
            block_table=self.kv_cache_manager.get_block_ids(req.request_id),
            group_block_tables=self.kv_cache_manager.get_group_block_ids(req.request_id),
            sample=start + num_new == req.num_tokens,
            sampling_params=params,
            generator=req.generator,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
            block_eos=req.num_output_tokens < params.min_tokens,
            constraints=req.constraints,
            # prompt logprobs: positions already scored before a preemption are not redone
            want_hidden_states=want_logprobs or want_hidden,
            prompt_logprobs_from=req.prompt_logprobs_upto,
            prompt_hidden_from=hidden_upto if want_hidden else None,
            stage_output_reads=reads,
            lora_id=req.lora_id,
            mm_inputs=self._encoder_inputs(req, start, start + num_new) if req.mm_items else (),
        )

    def _may_read_stage_outputs(self, req: Request) -> bool:
        """Whether the request, admitted now, could read cached stage outputs: its prompt's
        logprobs or hidden states over cache hits (`_scheduled`)."""
        if self.stage_outputs is None or not req.reads_stage_outputs:
            return False
        n_prompt = req.num_prompt_tokens
        params = req.sampling_params
        if params.prompt_logprobs is not None and req.prompt_logprobs_upto < n_prompt:
            return True
        upto = req.prompt_hidden_upto
        return upto is not None and (upto < n_prompt or params.return_hidden_states)

    def _commit_stage_rows(self, step: SchedulerOutput, accepted: dict[str, int]) -> None:
        """The booked step wrote its stage-output rows (ModelRunner.launch, PendingOutput.result):
        the blocks it completed, and those it loaded from the tiers, are readable now - those still
        held by a request of the step that was not preempted since (a block let go may have gone to
        another request, whose rows are still to come). `accepted`: the drafts kept per request
        (the rows of those rejected are not its)."""
        cache = self.stage_outputs
        assert cache is not None
        requests, preempted, bs = self.requests, self._preempted_in_flight, self.block_size
        kv = self.kv_cache_manager
        done: list[int] = []
        held: set[int] = set()
        for sr in step.scheduled:
            req = requests.get(sr.req_id)
            if req is None or sr.req_id in preempted:
                continue
            # it holds them still (a request's first group's blocks go only with it); a block
            # completed before its last token was known is entered in the cache now, to be readable
            end = sr.start + len(sr.token_ids) - len(sr.draft_token_ids) + accepted.get(sr.req_id, 0)
            kv.cache_full_blocks(req, end)
            table = sr.block_table
            done.extend(table[sr.start // bs : end // bs])
            if step.kv_loads:
                held.update(table[: sr.start // bs])
        done.extend(load.block_id for load in step.kv_loads if load.block_id in held)
        cache.commit(done)

    @staticmethod
    def _encoder_inputs(req: Request, start: int, end: int) -> tuple[EncoderInput, ...]:
        """The items (sorted by offset) overlapping tokens [start, end), with the rows each needs."""
        out = []
        for item in req.mm_items:
            a, b = max(start, item.offset), min(end, item.offset + item.length)
            if a < b:
                rows = (a - item.offset, b - item.offset)
                out.append(EncoderInput(item.identifier, item.data, rows, a - start, req.cache_salt))
        return tuple(out)

    def _preempt(self, req: Request) -> None:
        """Recompute later: free the blocks (they keep their identity, so the request re-hits
        whatever survives) and put the request back at the front of the queue."""
        self.kv_cache_manager.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.policy == "priority":
            self._insert_by_priority(req)
        else:
            self.waiting.appendleft(req)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> tuple[list[Request], list[Request]]:
        """Book a step's results: computed tokens, sampled tokens, prompt logprob progress, and
        requests that failed alone (finished with FINISHED_ERROR, blocks freed). Returns the
        requests that got a token (row i of the runner output) and the failed ones. Stop
        conditions are the engine's output processor's (they need the detokenized text)."""
        requests = self.requests
        if runner_output.kv_saved:  # the values of this step's saves, for the tiers to store
            self.kv_connector.saved(runner_output.kv_saved, self.requests, self.kv_cache_manager)
        accepted = runner_output.accepted_drafts
        if self.stage_outputs is not None:
            self._commit_stage_rows(scheduler_output, accepted)
        preempted = self._preempted_in_flight
        for sr in scheduler_output.scheduled:
            req = requests.get(sr.req_id)
            if req is None:
                continue
            if sr.req_id in preempted:  # since this step was launched: it recomputes from the start
                preempted.discard(sr.req_id)
                continue
            if sr.draft_token_ids:  # the K/V of rejected drafts is rewritten by the next steps
                kept = accepted.get(sr.req_id, 0)
                req.num_computed_tokens += len(sr.token_ids) - len(sr.draft_token_ids) + kept
                self.spec_stats.record(len(sr.draft_token_ids), kept)
                if self.draft_budget is not None:
                    self.draft_budget.record_verified(sr.req_id, len(sr.draft_token_ids), kept)
                continue
            req.num_computed_tokens += len(sr.token_ids)
        for req_id, scored in runner_output.prompt_logprobs.items():
            req = requests.get(req_id)
            if req is not None:
                req.prompt_logprobs_upto = scored.first + len(scored.logprobs)
        for req_id, (first, rows) in runner_output.hidden_states.items():
            req = requests.get(req_id)
            if req is not None:
                req.prompt_hidden_upto = first + len(rows)
        sampled: list[Request] = []
        now = time.time()
        latencies: list[float] = []
        self.last_inter_token_latencies = latencies
        last_id = None
        for req_id, token in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            req = requests.get(req_id)
            if req is None:  # it ended while the step ran (async scheduling: a stop seen a step late, an abort)
                continue
            req.append_output_token_ids(token)
            sampled.append(req)
            if req_id == last_id:  # a further token of a request that kept drafts: one latency a step
                continue
            last_id = req_id
            if req.first_token_time is None:
                req.first_token_time = now
            else:
                latencies.append(now - (req.last_token_time or now))
            req.last_token_time = now
        failed: list[Request] = []
        for req_id, message in runner_output.errors.items():
            req = requests.get(req_id)
            if req is not None:
                req.error = message
                req.finished_time = now
                self.finish_request(req, RequestStatus.FINISHED_ERROR)
                failed.append(req)
        return sampled, failed

    # -- the cache, through its owner ----------------------------------------------------------
    def reset_prefix_cache(self, keep_pinned: bool = False) -> bool:
        """Forget every cached identity (the pinned prefixes' too, unless `keep_pinned`); refused
        (False) while any request holds blocks."""
        return self.kv_cache_manager.reset_prefix_cache(keep_pinned)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.kv_cache_manager.stats

    def take_kv_events(self) -> list[KVCacheEvent]:
        events = self.kv_cache_manager.take_events()
        tier_events = self.kv_connector.take_events()  # the tiers', each under its own medium
        if tier_events:
            events.extend(tier_events)
        return events

    @property
    def num_dropped_kv_events(self) -> int:
        return self.kv_cache_manager.num_dropped_kv_events
