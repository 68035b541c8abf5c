"""The live request groups: their sequences' outputs turned into the client's, and their failures.

The engine registers each admitted group here; each step's sampled tokens come back through
`process_outputs`, which detokenizes, applies stop conditions and finishes stopped sequences in the
scheduler. A failure (a request's own, a failed forward pass, a request that can never fit) ends
the groups it touches with `RequestOutput.error` rather than raising.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable

from ..model.tokenizer import Tokenizer
from ..outputs import RequestOutput
from ..request import Request, RequestStatus
from ..sampling_params import RequestOutputKind
from .model_runner_output import ModelRunnerOutput
from .output_processor import logprob_entry, status_for
from .request_group import RequestGroup
from .scheduler import Scheduler
from .scheduler_output import SchedulerOutput

logger = logging.getLogger("prefixkv")


class RequestGroups:
    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        eos_ids: set[int],
        max_model_len: int,
        stream_interval: int = 1,
    ) -> None:
        """`stream_interval`: the engine's floor of how many tokens a streamed output gathers."""
        self.scheduler = scheduler
        self.stream_interval = stream_interval
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.groups: dict[str, RequestGroup] = {}  # by the client's request id
        self.child_of: dict[str, tuple[RequestGroup, int]] = {}  # engine-private sequence id -> (group, index)
        self.num_generation_tokens = 0
        self.num_requests_errored = 0
        self._ids = itertools.count()  # ids for requests that bring none

    def new_request_id(self, request_id: str | None) -> str:
        """The client's id, checked to be free, or a fresh one."""
        if request_id is None:
            request_id = str(next(self._ids))
            while request_id in self.groups:  # a client may have taken it
                request_id = str(next(self._ids))
        elif not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        elif request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        return request_id

    def add(self, group: RequestGroup) -> None:
        """Register a group and queue its sequences; cannot fail."""
        self.groups[group.request_id] = group
        for i, child in enumerate(group.children):
            self.child_of[child.request_id] = (group, i)
            self.scheduler.add_request(child)

    def end(self, group: RequestGroup, status: RequestStatus) -> None:
        """Finish every unfinished sequence of a group with `status` and forget the group."""
        for child, state in zip(group.children, group.states):
            if not child.is_finished:
                state.abort(child)
                self.scheduler.finish_request(child, status)
        self.forget(group)

    def forget(self, group: RequestGroup) -> None:
        self.groups.pop(group.request_id, None)
        for child in group.children:
            self.child_of.pop(child.request_id, None)

    def process_outputs(
        self, runner_output: ModelRunnerOutput, sampled: list[Request], failed: list[Request]
    ) -> list[RequestOutput]:
        """The output processor's half of the step: prompt logprobs, detokenized text, stop
        conditions (a stopped sequence is finished in the scheduler), failed groups."""
        for req_id, scored in runner_output.prompt_logprobs.items():
            child = self.child_of.get(req_id)
            if child is None:  # it ended while the step ran (async scheduling: an abort)
                continue
            group = child[0]
            entries = group.prompt_logprobs
            if entries is None:  # only groups that asked are scored
                continue
            prompt = group.prompt_token_ids
            for pos, p_lp, p_rank, p_top in zip(
                itertools.count(scored.first), scored.logprobs, scored.ranks, scored.top
            ):
                entries.append(logprob_entry(self.tokenizer, prompt[pos], p_lp, p_rank, p_top))
        for req_id, (_, rows) in runner_output.hidden_states.items():
            child = self.child_of.get(req_id)
            hidden = None if child is None else child[0].hidden_states
            if hidden is not None:
                hidden.append(rows)
        touched: dict[str, RequestGroup] = {}
        ended: set[str] = set()  # groups with a sequence that ended or failed in this step
        now = time.time()
        lps, tops, ranks = runner_output.logprobs, runner_output.top_logprobs, runner_output.ranks
        sampled_rows: Iterable[int] = range(len(sampled))
        if len(sampled) != len(runner_output.req_ids):  # rows of ended requests were skipped (async scheduling)
            row_of = {rid: i for i, rid in enumerate(runner_output.req_ids)}
            sampled_rows = [row_of[req.request_id] for req in sampled]
        # a request that kept drafts has a row per token, one after another: each row is taken
        # as if its token were the last, and those after a stop are dropped
        later = _rows_after(runner_output.req_ids) if runner_output.accepted_drafts else None
        ended_rows: set[str] = set()
        for row, req in zip(sampled_rows, sampled):
            if ended_rows and req.request_id in ended_rows:
                continue
            self.num_generation_tokens += 1
            group, idx = self.child_of[req.request_id]
            touched[group.request_id] = group
            token = runner_output.sampled_token_ids[row]
            after = later[row] if later is not None else 0
            lp: float | None = None
            top: list[tuple[int, float]] | None = None
            rank: int | None = None
            if lps is not None and tops is not None and ranks is not None and req.sampling_params.logprobs is not None:
                lp, top, rank = lps[row], tops[row], ranks[row]
            try:
                done = group.states[idx].update(req, token, self.eos_ids, self.max_model_len, lp, top, rank, after)
            except Exception as e:  # noqa: BLE001 (e.g. detokenizing: this request fails alone)
                req.error = f"processing the output failed: {type(e).__name__}: {e}"
                failed.append(req)
                if after:
                    ended_rows.add(req.request_id)
                continue
            if done:
                if after:
                    req.discard_output_tokens(after)
                    ended_rows.add(req.request_id)
                ended.add(group.request_id)
                req.finished_time = now
                self.scheduler.finish_request(req, status_for(group.states[idx].finish_reason or "stop"))
        for req in failed:
            entry = self.child_of.get(req.request_id)
            if entry is not None:
                self.fail(entry[0], req.error or "the request failed")
                touched[entry[0].request_id] = entry[0]
                ended.add(entry[0].request_id)
        outputs = []
        for group_id, group in touched.items():
            final_only = group.output_kind is RequestOutputKind.FINAL_ONLY
            if final_only and group_id not in ended:
                continue  # none of its sequences ended in this step: it goes on, and shows nothing yet
            finished = group.finished
            if not finished and final_only:
                continue  # nothing is built for it until it ends
            if not finished and not self.streams_now(group):
                continue  # it gathers tokens for its next output
            outputs.append(group.output(finished, now))
            if finished:
                self.forget(group)
        return outputs

    def streams_now(self, group: RequestGroup) -> bool:
        """vLLM's stream interval: a running group's first output at once, then one each time its
        sequences gained the interval's count of tokens (the request's, at least the engine's)."""
        interval = max(self.stream_interval, group.children[0].sampling_params.stream_interval or 1)
        if interval == 1:
            return True
        total = 0
        for child in group.children:
            total += child.num_output_tokens
        if group.streamed_tokens >= 0 and total - group.streamed_tokens < interval:
            return False
        group.streamed_tokens = total
        return True

    def fail(self, group: RequestGroup, message: str) -> None:
        if group.error is None:
            group.error = message
            self.num_requests_errored += 1
            logger.warning("request %s failed: %s", group.request_id, message)
        for child, state in zip(group.children, group.states):
            if child.request_id in self.scheduler.requests:
                self.scheduler.finish_request(child, RequestStatus.FINISHED_ERROR)
            if child.status is RequestStatus.FINISHED_ERROR or state.finish_reason is None:
                state.abort(child)

    def fail_step(self, scheduler_output: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """The forward pass failed: the batch's new blocks were entered in the cache table but
        hold no valid KV. Fail the batch's requests and forget every cached identity so no later
        request hits them; if other requests hold blocks the table cannot be reset under them,
        so they fail too. The engine keeps serving."""
        logger.error("the model failed in a step of %d requests", len(scheduler_output.scheduled), exc_info=exc)
        message = f"the model failed: {type(exc).__name__}: {exc}"
        groups = self.groups_of([sr.req_id for sr in scheduler_output.scheduled])
        for group in groups:
            self.fail(group, message)
        if not self.scheduler.reset_prefix_cache():
            others = self.groups_of([r.request_id for r in self.scheduler.running])
            for group in others:
                self.fail(group, message)
            groups += others
            self.scheduler.reset_prefix_cache()
        outputs = [g.output() for g in groups]
        for group in groups:
            self.forget(group)
        return outputs

    def fail_unschedulable(self) -> list[RequestOutput]:
        """Nothing could be scheduled although requests wait (a request that can never fit):
        fail the head of the queue rather than spin."""
        head = self.scheduler.waiting[0]
        group = self.child_of[head.request_id][0]
        self.fail(group, "the request cannot be scheduled: it does not fit in the KV cache")
        out = group.output()
        self.forget(group)
        return [out]

    def groups_of(self, req_ids: list[str]) -> list[RequestGroup]:
        seen: dict[str, RequestGroup] = {}
        for rid in req_ids:
            entry = self.child_of.get(rid)
            if entry is not None:
                seen.setdefault(entry[0].request_id, entry[0])
        return list(seen.values())

    # -- KV events -----------------------------------------------------------------------------


def _rows_after(req_ids: list[str]) -> list[int]:
    """Per row, how many rows after it belong to the same request (a request's rows are one after
    another)."""
    after = [0] * len(req_ids)
    for row in range(len(req_ids) - 2, -1, -1):
        if req_ids[row] == req_ids[row + 1]:
            after[row] = after[row + 1] + 1
    return after
