"""Run stages in order; a connector turns one stage's outputs into the next stage's prompts."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .stages import HeadStage, LLMStage, StageOutput

Connector = Callable[[StageOutput], "str | list[int]"]


def _answer_text(out: StageOutput) -> str:
    return out.text


class Pipeline:
    """`stages[0]` takes the user's prompts; each later `LLMStage` takes prompts built by its
    connector (default: the previous stage's generated text) from the previous stage's outputs; a
    `HeadStage` takes the previous stage's outputs themselves (their hidden states). `run`
    returns every stage's outputs, one list per stage, in request order."""

    def __init__(self, stages: Sequence[LLMStage | HeadStage], connectors: dict[str, Connector] | None = None) -> None:
        if not stages:
            raise ValueError("a pipeline needs at least one stage")
        if isinstance(stages[0], HeadStage):
            raise ValueError("the first stage must be an LLMStage: a head needs a previous stage's hidden states")
        names = [s.name for s in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")
        unknown = set(connectors or {}) - set(names[1:])
        if unknown:
            raise ValueError(f"connectors for unknown or first stages: {sorted(unknown)}")
        self.stages = list(stages)
        self.connectors = dict(connectors or {})

    def run(self, prompts: Sequence[str | list[int]]) -> list[list[StageOutput]]:
        results: list[list[StageOutput]] = []
        for i, stage in enumerate(self.stages):
            if i == 0:
                assert isinstance(stage, LLMStage)
                results.append(stage.run(prompts))
            elif isinstance(stage, HeadStage):
                results.append(stage.run_on(results[-1]))
            else:
                connect = self.connectors.get(stage.name, _answer_text)
                results.append(stage.run([connect(prev) for prev in results[-1]]))
        return results
