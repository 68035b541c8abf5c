"""The stages of a pipeline and what one hands to the next."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..llm import LLM
from ..sampling_params import SamplingParams
from ..stage_outputs.pooling import PoolingParams


@dataclass
class StageOutput:
    """One request's result at one stage. `token_ids` are the generated ones (empty for an
    embedding or a head stage); `hidden_states` the final hidden state of every computed position
    (prompt, then output but its last token) when the stage keeps them; `data` the stage's own
    product (an embedding, a head's output); `num_cached_tokens` the prompt tokens its prefix
    cache served."""

    stage: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    hidden_states: torch.Tensor | None = field(default=None, repr=False)
    data: Any = field(default=None, repr=False)
    num_cached_tokens: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.token_ids


class LLMStage:
    """A stage on its own prefixkv engine, so its prefix cache (and stage-output cache) is its
    own: `task="generate"` runs `llm.generate` with `sampling_params` (hidden states returned
    when `return_hidden_states`), `task="embed"` runs `llm.embed` with `pooling_params`. `llm`
    is an `LLM`, or the keywords to build one (its stage config)."""

    def __init__(
        self,
        name: str,
        llm: LLM | dict[str, Any],
        *,
        task: str = "generate",
        sampling_params: SamplingParams | None = None,
        pooling_params: PoolingParams | None = None,
        return_hidden_states: bool = False,
    ) -> None:
        if task not in ("generate", "embed"):
            raise ValueError(f"stage {name!r}: task must be 'generate' or 'embed', got {task!r}")
        if task == "embed" and (sampling_params is not None or return_hidden_states):
            raise ValueError(f"stage {name!r}: an embed stage takes pooling_params, not sampling_params")
        if task == "generate" and pooling_params is not None:
            raise ValueError(f"stage {name!r}: a generate stage takes sampling_params, not pooling_params")
        self.name = name
        self.llm = llm if isinstance(llm, LLM) else LLM(**llm)
        self.task = task
        self.pooling_params = pooling_params
        params = sampling_params or SamplingParams()
        if return_hidden_states and not params.return_hidden_states:
            params = replace(params, return_hidden_states=True)
        self.sampling_params = params

    def run(self, prompts: Sequence[str | list[int]]) -> list[StageOutput]:
        items = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
        if self.task == "embed":
            outs = self.llm.embed(items, pooling_params=self.pooling_params, use_tqdm=False)
            return [
                StageOutput(
                    self.name,
                    list(o.prompt_token_ids),
                    data=torch.tensor(o.outputs.embedding),
                    num_cached_tokens=o.num_cached_tokens,
                )
                for o in outs
            ]
        results = []
        for o in self.llm.generate(items, self.sampling_params, use_tqdm=False):
            if o.error is not None:
                raise RuntimeError(f"stage {self.name!r}: request {o.request_id} failed: {o.error}")
            c = o.outputs[0]
            results.append(
                StageOutput(
                    self.name,
                    list(o.prompt_token_ids),
                    list(c.token_ids),
                    c.text,
                    o.hidden_states,
                    num_cached_tokens=o.num_cached_tokens,
                )
            )
        return results


class HeadStage:
    """A small model over the previous stage's hidden states (a probe, a reward or a speech head):
    `head` maps `(num_positions, hidden_size)` to anything. Its input must come from a stage that
    returned hidden states; its outputs carry that stage's tokens, text and hidden states on, with
    the head's result in `data`, so a later stage can still build its prompt from them."""

    def __init__(self, name: str, head: Callable[[torch.Tensor], Any]) -> None:
        self.name = name
        self.head = head

    @torch.inference_mode()
    def run_on(self, previous: Sequence[StageOutput]) -> list[StageOutput]:
        results = []
        for prev in previous:
            if prev.hidden_states is None:
                raise ValueError(
                    f"stage {self.name!r} needs hidden states: run stage {prev.stage!r} with return_hidden_states=True"
                )
            results.append(
                StageOutput(
                    self.name,
                    prev.prompt_token_ids,
                    prev.token_ids,
                    prev.text,
                    prev.hidden_states,
                    data=self.head(prev.hidden_states),
                    num_cached_tokens=prev.num_cached_tokens,
                )
            )
        return results
