"""vLLM's prompt dicts (`vllm.inputs`): what LLM.generate takes besides a string or token ids.

Plain TypedDicts - `TokensPrompt(prompt_token_ids=[...])` is a dict - so a script written for
vLLM runs by changing the import. Their other vLLM fields (mm_processor_kwargs,
multi_modal_uuids, token_type_ids) are refused by name by LLM.generate."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine."""

    prompt: str
    multi_modal_data: NotRequired[dict[str, Any]]  # {"image": a PIL image or a list of them}
    cache_salt: NotRequired[str]  # keeps this prompt's cached blocks apart (per tenant)


class TokensPrompt(TypedDict):
    """A prompt already tokenized; `prompt` (optional) is the text the ids came from, returned as
    RequestOutput.prompt."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    multi_modal_data: NotRequired[dict[str, Any]]
    cache_salt: NotRequired[str]


SingletonPrompt = str | TextPrompt | TokensPrompt
PromptType = SingletonPrompt  # vLLM's name for what generate() takes per prompt

__all__ = ["PromptType", "SingletonPrompt", "TextPrompt", "TokensPrompt"]
