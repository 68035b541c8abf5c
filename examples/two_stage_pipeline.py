"""A two-stage pipeline in the spirit of vLLM-Omni, on the default model (no download):

stage 1 "thinker"  answers questions about one shared document (its own engine: the document's
                   KV and hidden states are cached once and reused by every question) and hands
                   its tokens, text and final hidden states on;
head "probe"       a small linear head over the thinker's hidden states (here random weights: a
                   stand-in for a reward, classifier or speech head) - one score per position;
stage 2 "critic"   embeds each answer behind a fixed rating instruction (MEAN pooling) on a second
                   engine, whose prefix cache serves the instruction to every answer after the first.

    .venv/bin/python examples/two_stage_pipeline.py
"""

from __future__ import annotations

from prefixkv import LLM, SamplingParams
from prefixkv.pipeline import HeadStage, LLMStage, Pipeline
from prefixkv.stage_outputs import PoolingParams

DOCUMENT = (
    "The lighthouse keeper's log, autumn. The lamp was lit at dusk each day; fog came in from the "
    "west on the ninth and stayed three days; a fishing boat, the Marten, anchored in the lee of the "
    "point during the storm of the fourteenth and left at dawn with all hands well. " * 4
)
QUESTIONS = ["When was the lamp lit?", "Which boat anchored during the storm?", "How long did the fog stay?"]
INSTRUCTION = "Rate how well this answer is grounded in a keeper's log, for clarity and accuracy. Answer: "


def main() -> None:
    import torch

    engine_args = dict(enable_stage_output_cache=True, max_model_len=2048)
    thinker = LLMStage(
        "thinker",
        engine_args,
        sampling_params=SamplingParams(temperature=0, max_tokens=24),
        return_hidden_states=True,
    )
    torch.manual_seed(0)
    probe = torch.nn.Linear(thinker.llm.llm_engine.model_config.hidden_size, 1)
    head = HeadStage("probe", lambda h: probe(h.float()).squeeze(-1))
    critic = LLMStage("critic", LLM(**engine_args), task="embed", pooling_params=PoolingParams("mean"))
    pipe = Pipeline([thinker, head, critic], connectors={"critic": lambda out: INSTRUCTION + out.text.strip()})

    prompts = [f"{DOCUMENT}\nQuestion: {q}\nAnswer:" for q in QUESTIONS]
    answers, scores, critiques = pipe.run(prompts)
    for q, a, s, c in zip(QUESTIONS, answers, scores, critiques):
        print(f"Q: {q}\nA: {a.text.strip()!r}")
        print(
            f"   thinker: {len(a.prompt_token_ids)} prompt tokens, {a.num_cached_tokens} from its cache; "
            f"hidden states {tuple(a.hidden_states.shape)}; probe mean {s.data.mean().item():+.3f}"
        )
        print(
            f"   critic : {len(c.prompt_token_ids)} tokens, {c.num_cached_tokens} from its cache; "
            f"embedding dim {c.data.shape[0]}"
        )


if __name__ == "__main__":
    main()
