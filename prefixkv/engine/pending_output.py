"""A step the model runner has launched whose sampled tokens may still be computing on the device.

With async scheduling (llm_engine.py) the engine launches the next step before it reads this
one's tokens: the next step's decoding rows take their input ids straight from `tokens` on the
device, and the host books this step (`result()`) while the device computes the next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..model.host_copy import HostCopies, tensor_on
from ..speculative import keep_accepted, rewind_generators
from ..stage_outputs.store import StagedRows
from ..tiers.connector import PendingLoads, PendingSaves
from .model_runner_output import ModelRunnerOutput, PromptLogprobs
from .sampler import SampledTensors, SampleResult


@dataclass(slots=True)
class PromptScores:
    """One chunk's prompt logprobs as the device computed them (sampler.score_rows, in slices),
    copied to the host in stream order: tokens `first`, `first + 1`, ... and the top `k` of each
    position, read as PromptLogprobs when the step is (`PendingOutput.result`)."""

    first: int
    k: int
    # each slice's logprobs of its tokens and their ranks, then (k > 0) its top values and ids
    copies: HostCopies

    def read(self) -> PromptLogprobs:
        tensors = self.copies.wait()
        scored = PromptLogprobs(self.first, [], [], [])
        per_slice = 4 if self.k else 2
        for at in range(0, len(tensors), per_slice):
            chosen, ranks = tensors[at], tensors[at + 1]
            scored.logprobs.extend(chosen.tolist())
            scored.ranks.extend(ranks.tolist())
            if self.k:
                values, ids = tensors[at + 2], tensors[at + 3]
                scored.top.extend(list(zip(t, v)) for t, v in zip(ids.tolist(), values.tolist()))
            else:
                scored.top.extend([] for _ in range(len(chosen)))
        return scored


@dataclass(slots=True)
class PendingOutput:
    out: ModelRunnerOutput  # all but the sampled rows, prompt scores, hidden states and tier saves: errors
    req_ids: list[str] = field(default_factory=list)  # the sampled rows' requests, in row order
    sampled: SampledTensors | SampleResult | None = None
    # [rows] whether each row's logits were finite, checked when the tokens are read (None: checked
    # before sampling); a row that was not is sampled from zeros and its token dropped here
    finite: torch.Tensor | None = None
    # requests' prompt logprobs and hidden states (first position, rows) still on the device,
    # into `out` when read
    prompt_scores: dict[str, PromptScores] = field(default_factory=dict)
    hidden_states: dict[str, tuple[int, HostCopies]] = field(default_factory=dict)
    # Host memory's share of the step, done when it is booked, in this order (as a step in order
    # does it): the tier loads' stage-output rows (None: none, or put in at launch), the step's
    # own stage-output rows, then the tier saves (copied out in stream order; their stage-output
    # rows gathered when sealed)
    kv_loads: PendingLoads | None = None
    stage_rows: StagedRows | None = None
    kv_saves: PendingSaves | None = None
    # speculative decoding: each verifying request's drafts (its rows are one after another), and
    # its seeded generator with the state before the step, set back when the kept rows are known
    drafts: dict[str, Sequence[int]] | None = None
    generator_states: dict[str, tuple[torch.Generator, torch.Tensor]] | None = None
    _finite_host: HostCopies | None = None
    _finite_in_tokens: bool = False  # the copied tokens are -1 where a row was not finite
    _result: ModelRunnerOutput | None = None

    def start_reading(self) -> None:
        """Start copying the draws and row checks to the host, in stream order, before a later step
        is launched: `result()` then waits for this step alone (host_copy.HostCopies)."""
        if isinstance(self.sampled, SampledTensors):  # one copy for the draws and the row checks
            self.sampled.start_reading(self.finite)
            self._finite_in_tokens = self.finite is not None
        elif self.finite is not None:
            self._finite_host = HostCopies([self.finite])

    def tokens_of(self, req_ids: list[str], device: torch.device) -> torch.Tensor:
        """The tokens sampled for `req_ids` [len(req_ids)] on `device`, without waiting for them (0
        for a request this step sampled nothing for: its step failed, and so will the request)."""
        if isinstance(self.sampled, SampledTensors):
            tokens = self.sampled.tokens
        elif isinstance(self.sampled, SampleResult):
            tokens = tensor_on(self.sampled.token_ids, device, torch.long)
        else:
            return torch.zeros(len(req_ids), dtype=torch.long, device=device)
        if req_ids == self.req_ids:  # the same requests in the same order: the usual decode step
            return tokens.to(device)
        row_of = {rid: i for i, rid in enumerate(self.req_ids)}
        rows = [row_of.get(rid, -1) for rid in req_ids]
        padded = torch.cat([tokens.to(device), torch.zeros(1, dtype=tokens.dtype, device=device)])
        return padded[tensor_on([r if r >= 0 else len(tokens) for r in rows], device, torch.long)]

    def result(self) -> ModelRunnerOutput:
        """The step's output, waiting for the device if it has not finished (once; then cached)."""
        if self._result is not None:
            return self._result
        out = self.out
        if self.kv_loads is not None:
            self.kv_loads.finish()
        if self.stage_rows is not None:
            self.stage_rows.write()
        if self.kv_saves is not None:
            out.kv_saved = self.kv_saves.result()
        for req_id, scores in self.prompt_scores.items():
            out.prompt_logprobs[req_id] = scores.read()
        for req_id, (first, rows) in self.hidden_states.items():
            out.hidden_states[req_id] = (first, rows.wait()[0])
        sampled = self.sampled
        if sampled is not None:
            got = sampled.result() if isinstance(sampled, SampledTensors) else sampled
            keep = None
            if self._finite_in_tokens:
                keep = [t >= 0 for t in got.token_ids]
            elif self.finite is not None:
                finite = self._finite_host.wait()[0] if self._finite_host is not None else self.finite
                keep = finite.tolist()
            if keep is not None and not all(keep):
                for rid, ok in zip(self.req_ids, keep):
                    if not ok:
                        out.errors[rid] = "the model produced non-finite logits"
                got = _rows(got, keep)
            out.req_ids = [rid for rid, ok in zip(self.req_ids, keep or [True] * len(self.req_ids)) if ok]
            out.sampled_token_ids = got.token_ids
            out.logprobs, out.ranks, out.top_logprobs = got.logprobs, got.ranks, got.top_logprobs
            if self.drafts:
                columns = (out.logprobs, out.ranks, out.top_logprobs)
                out.req_ids, out.sampled_token_ids, kept, out.accepted_drafts = keep_accepted(
                    out.req_ids, out.sampled_token_ids, self.drafts, out.errors, columns
                )
                out.logprobs, out.ranks, out.top_logprobs = kept
                if self.generator_states:
                    rewind_generators(self.generator_states, out.accepted_drafts)
        self._result = out
        return out


def _rows(got: SampleResult, keep: list[bool]) -> SampleResult:
    def pick(values: list[Any] | None) -> list[Any] | None:
        return None if values is None else [v for v, ok in zip(values, keep) if ok]

    return SampleResult(
        [t for t, ok in zip(got.token_ids, keep) if ok], pick(got.logprobs), pick(got.top_logprobs), pick(got.ranks)
    )
