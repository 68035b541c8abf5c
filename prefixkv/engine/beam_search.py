"""Beam search, as vLLM's LLM.beam_search: the `beam_width` best sequences of a prompt by score,
found one token at a time.

Each step runs every live beam as a one-token request - prompt = the prompt plus the beam's
tokens - asking for its top 2 * beam_width log-probabilities (the sampled token is dropped). The
candidates of all beams are ranked together: those ending in an EOS (unless ignore_eos) are set
aside as finished, the best `beam_width` others are the next step's beams. After max_tokens steps
(or when no beam is left) the finished and live beams are ranked together and the best
`beam_width` returned.

Score (vLLM's get_beam_search_score): cum_logprob / length ** length_penalty, length counting the
prompt and the output but not the EOS that finished a beam (vLLM drops a final EOS under
ignore_eos too; here it is a token like any other then, as in transformers). The
log-probabilities are the model's raw ones, so temperature changes nothing, as in vLLM.
`max_tokens` stops where the context does: a beam never grows past max_model_len tokens.

The beams of a prompt share the prompt and most of their tokens: the engine's automatic prefix
cache hands each step's requests the blocks the previous step computed, so a step computes only
each beam's tokens past its last full cached block (at most block_size). `BeamSearch` is the
search alone (no engine), so the server drives the same search through its async engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ..lora.request import LoRARequest
from ..outputs import Logprob, RequestOutput
from ..sampling_params import BeamSearchParams, SamplingParams
from .beam_output import BeamSearchOutput, BeamSearchSequence
from .llm_engine import LLMEngine


def step_params(params: BeamSearchParams) -> SamplingParams:
    """One step of one beam: a greedy token (dropped) and the top 2 * beam_width logprobs."""
    return SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * params.beam_width, detokenize=False)


def check_beam_width(params: BeamSearchParams, max_logprobs: int) -> None:
    """A step asks for 2 * beam_width logprobs: refuse a width the engine's max_logprobs cannot serve."""
    params.verify()
    if 2 * params.beam_width > max_logprobs:
        raise ValueError(
            f"beam_width={params.beam_width} needs the top {2 * params.beam_width} logprobs of every step; "
            f"this engine allows at most {max_logprobs} (max_logprobs), so beam_width <= {max_logprobs // 2}"
        )


class BeamSearch:
    """One prompt's search: its live beams, the finished ones, and the steps left."""

    def __init__(
        self,
        prompt_token_ids: Sequence[int],
        params: BeamSearchParams,
        eos_ids: set[int],
        max_model_len: int,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.params = params
        self.eos_ids = eos_ids
        self.prompt_len = len(prompt_token_ids)
        self.beams = [BeamSearchSequence(list(prompt_token_ids), lora_request=lora_request)]
        self.completed: list[BeamSearchSequence] = []
        # a beam is a prompt: it must leave the context room for its next token
        self.steps_left = min(params.max_tokens, max_model_len - self.prompt_len)

    @property
    def live(self) -> list[BeamSearchSequence]:
        """The beams the next step extends (none once the search is over)."""
        return self.beams if self.steps_left > 0 else []

    def score(self, seq: BeamSearchSequence) -> float:
        """vLLM's score: an EOS that ended the beam is not counted in its length."""
        length = len(seq.tokens) - 1 if seq.finish_reason == "stop" else len(seq.tokens)
        return seq.cum_logprob / math.pow(length, self.params.length_penalty)

    def advance(self, tops: Sequence[dict[int, Logprob]]) -> None:
        """Take one step: `tops[i]` is live beam i's top 2 * beam_width next tokens, best first."""
        width, ignore_eos = self.params.beam_width, self.params.ignore_eos
        # (cum_logprob, beam, token, top), in vLLM's order: beam by beam, best token first. The
        # live candidates all have one length, so ranking them by score is ranking them by
        # cum_logprob; the sort is stable, so ties keep that order, as in vLLM
        candidates: list[tuple[float, BeamSearchSequence, int, dict[int, Logprob]]] = []
        for beam, top in zip(self.beams, tops):
            for token, lp in top.items():
                cum = beam.cum_logprob + lp.logprob
                if token in self.eos_ids and not ignore_eos:
                    self.completed.append(self._extend(beam, token, top, cum, "stop"))
                else:
                    candidates.append((cum, beam, token, top))
        candidates.sort(key=lambda c: c[0], reverse=True)
        self.beams = [self._extend(beam, token, top, cum) for cum, beam, token, top in candidates[:width]]
        self.steps_left = self.steps_left - 1 if self.beams else 0

    @staticmethod
    def _extend(
        beam: BeamSearchSequence, token: int, top: dict[int, Logprob], cum: float, finish: str | None = None
    ) -> BeamSearchSequence:
        return BeamSearchSequence(
            beam.tokens + [token],
            beam.logprobs + [top],
            beam.lora_request,
            cum,
            finish_reason=finish,
            stop_reason=token if finish == "stop" else None,
        )

    def best(self) -> list[BeamSearchSequence]:
        """The best `beam_width` of the finished and live beams, best first (call once the search
        is over); the beams still live end by length."""
        ranked = sorted(self.completed + self.beams, key=self.score, reverse=True)[: self.params.beam_width]
        for seq in ranked:
            if seq.finish_reason is None:
                seq.finish_reason = "length"
        return ranked


def top_logprobs(out: RequestOutput) -> dict[int, Logprob]:
    """The step's candidates from a finished one-token request; RuntimeError when it failed."""
    if out.error is not None:
        raise RuntimeError(f"a beam search step failed: {out.error}")
    logprobs = out.outputs[0].logprobs
    if not logprobs:
        raise RuntimeError(f"a beam search step returned no logprobs (finish_reason {out.outputs[0].finish_reason})")
    return logprobs[0]


def run_beam_search(
    engine: LLMEngine,
    searches: Sequence[BeamSearch],
    params: BeamSearchParams,
    cache_salts: Sequence[str | None],
) -> None:
    """Drive `searches` (all with `params`) to their end on `engine` - offline: this thread steps
    the engine - every live beam of every search in one batch per step. An interrupt or a
    failure aborts the step's requests, so no KV block stays held."""
    inputs, one_step = engine.input_processor, step_params(params)
    while True:
        work = [(salt, beam) for s, salt in zip(searches, cache_salts) for beam in s.live]
        if not work:
            return
        ids: list[str] = []
        try:
            for salt, beam in work:
                req = inputs.process(beam.tokens, one_step, lora_request=beam.lora_request, cache_salt=salt)
                ids.append(engine.add_processed(req))
            done = _run(engine, ids)
        except BaseException:
            engine.abort_request(ids)
            raise
        tops = iter(top_logprobs(done[rid]) for rid in ids)
        for search in searches:
            if search.live:
                search.advance([next(tops) for _ in search.live])


def _run(engine: LLMEngine, request_ids: list[str]) -> dict[str, RequestOutput]:
    pending, done = set(request_ids), {}
    while pending:
        for out in engine.step():
            if out.finished and out.request_id in pending:
                pending.discard(out.request_id)
                done[out.request_id] = out
                if out.error is not None:  # the step failed: raise now (the caller aborts the rest)
                    top_logprobs(out)
    return done


def outputs_of(searches: Sequence[BeamSearch], decode: Callable[[list[int]], str]) -> list[BeamSearchOutput]:
    """Each search's best sequences with their text (the whole sequence, as vLLM's offline text)."""
    outs = []
    for search in searches:
        best = search.best()
        for seq in best:
            seq.text = decode(seq.tokens)
        outs.append(BeamSearchOutput(best))
    return outs
