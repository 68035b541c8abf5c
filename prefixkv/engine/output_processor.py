"""Per-request output state: detokenized text, stop strings and stop tokens, finish reasons."""

from __future__ import annotations

from collections.abc import Sequence

from ..model import Tokenizer
from ..outputs import CompletionOutput, Logprob
from ..request import Request, RequestStatus
from ..sampling_params import RequestOutputKind, SamplingParams


def logprob_entry(
    tokenizer: Tokenizer, token: int, logprob: float, rank: int, top: list[tuple[int, float]]
) -> dict[int, Logprob]:
    """vLLM's per-position logprobs: the top tokens (ranked 1..k) plus the actual token."""

    def piece(tid: int) -> str:
        return tokenizer.decode([tid], skip_special_tokens=False)

    entry = {tid: Logprob(lp, r + 1, piece(tid)) for r, (tid, lp) in enumerate(top)}
    entry.setdefault(token, Logprob(logprob, rank, piece(token)))
    return entry


# prompt tokens a sequence's text is decoded after (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
DETOKENIZE_CONTEXT = 5


class OutputState:
    """Text for one sequence. While the sequence runs, `text` withholds what may still change:
    a tail that could begin a stop string, or an incomplete UTF-8 character - so streamed text
    only ever grows.

    A sequence whose text nobody reads before it ends (FINAL_ONLY, no stop strings: every
    `LLM.generate` without `stop`) is not detokenized token by token: its text is the one whole
    decode made when it ends, which the incremental text is replaced by anyway. That is one
    native call less per token: a batch-256 step's output work went from 8.6 to 3.6-4.2 us a
    request on an AMD EPYC Zen 4 (bench/host_overhead.py)."""

    def __init__(
        self, index: int, params: SamplingParams, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = ()
    ) -> None:
        self.index = index
        self.params = params
        self.tokenizer = tokenizer
        self.full_text = ""
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self._holdback = max((len(s) for s in params.stop or ()), default=1) - 1
        # the text reads on from the prompt's last tokens, as vLLM's (its first word keeps its space)
        self._context = (
            tokenizer.reading_context(prompt_token_ids, params.skip_special_tokens, DETOKENIZE_CONTEXT)
            if params.detokenize
            else []
        )
        # the incremental text: wanted while the sequence runs (streamed or cumulative outputs, stop
        # strings to find); None: the text is the one decode at the end
        incremental = params.detokenize and (
            params.output_kind is not RequestOutputKind.FINAL_ONLY or bool(params.stop)
        )
        self._stream = tokenizer.decode_stream(params.skip_special_tokens, self._context) if incremental else None

    def update(
        self,
        req: Request,
        token: int,
        eos_ids: set[int],
        max_model_len: int,
        logprob: float | None = None,
        top: list[tuple[int, float]] | None = None,
        rank: int | None = None,
        later: int = 0,
    ) -> bool:
        """Account for the token appended to `req`, `later` tokens before its last (a step that
        kept drafts appended several: each is accounted for in turn, as if it were the last).
        Returns True when the sequence ends."""
        p = self.params
        if self.logprobs is not None and logprob is not None and rank is not None:
            self.logprobs.append(logprob_entry(self.tokenizer, token, logprob, rank, top or []))
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + logprob
        n_out = req.num_output_tokens - later
        outputs = req.output_token_ids[:n_out] if later else req.output_token_ids
        if self._stream is not None:  # one native decode call per token; incomplete characters wait
            self.full_text += self._stream.step(outputs)
        grammar = req.constraints.grammar if req.constraints is not None else None
        if grammar is not None:  # the grammar sees every accepted token; its end is the output's
            grammar.accept(token)
            if grammar.is_terminated:
                return self._finish("stop", None, strip_last_token=token in eos_ids, outputs=outputs)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in eos_ids:
                return self._finish("stop", None, strip_last_token=True, outputs=outputs)
            if token in (p.stop_token_ids or ()):
                return self._finish("stop", token, strip_last_token=True, outputs=outputs)
            if p.stop and p.detokenize:
                start = max(0, len(self.text) - self._holdback - 1)
                for stop in p.stop:
                    at = self.full_text.find(stop, start)
                    if at != -1:
                        end = at + len(stop) if p.include_stop_str_in_output else at
                        self.full_text = self.full_text[:end]
                        return self._finish("stop", stop)
        if (p.max_tokens is not None and n_out >= p.max_tokens) or req.num_tokens - later >= max_model_len:
            return self._finish("length", None, outputs=outputs)
        rd = p.repetition_detection
        if rd is not None and rd.max_pattern_size and n_out >= p.min_tokens and rd.repeats(outputs):
            return self._finish("repetition", "repetition_detected", outputs=outputs)
        stable = self.full_text
        if p.stop:
            stable = stable[: max(len(self.text), len(stable) - self._holdback)]
        self.text = stable
        return False

    def _finish(
        self,
        reason: str,
        stop_reason: int | str | None,
        strip_last_token: bool = False,
        outputs: Sequence[int] | None = None,
    ) -> bool:
        """`outputs`: the request's output tokens up to the one it ends on, decoded whole for the
        final text (None: the text so far is final)."""
        if outputs is not None and self.params.detokenize:
            # the final text is one full decode: characters still held back are flushed, and an
            # EOS / stop token stays in token_ids (as in vLLM) but not in the text
            ids = outputs[:-1] if strip_last_token else outputs
            self.full_text = self.tokenizer.decode_after(self._context, ids, self.params.skip_special_tokens)
        self.text = self.full_text
        self.finish_reason = reason
        self.stop_reason = stop_reason
        return True

    def abort(self, req: Request | None = None) -> None:
        """The sequence ends early (aborted, failed): its text so far (`req`: the sequence, for
        the text that was not decoded token by token)."""
        if req is not None and self.params.detokenize and self._stream is None:
            self.full_text = self.tokenizer.decode_after(
                self._context, req.output_token_ids, self.params.skip_special_tokens
            )
        self.finish_reason = "abort"
        self.text = self.full_text

    def completion(self, req: Request) -> CompletionOutput:
        return CompletionOutput(
            self.index,
            self.text,
            list(req.output_token_ids),
            self.cumulative_logprob,
            list(self.logprobs) if self.logprobs is not None else None,
            self.finish_reason,
            self.stop_reason,
        )


def status_for(reason: str) -> RequestStatus:
    return {
        "stop": RequestStatus.FINISHED_STOPPED,
        "length": RequestStatus.FINISHED_LENGTH,
        "repetition": RequestStatus.FINISHED_STOPPED,  # vLLM's own reason: a pattern repeated
        "abort": RequestStatus.FINISHED_ABORTED,
    }[reason]
