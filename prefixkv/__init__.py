"""prefixkv: an LLM inference engine built around exact automatic prefix caching.

vLLM's interface (`LLM`, `SamplingParams`, an OpenAI-compatible server); the layers, the exact
block identity and where to add a model, a policy or a route: docs/design.md.
"""

from .inputs import PromptType, TextPrompt, TokensPrompt
from .lora.request import LoRARequest
from .multimodal.item import MultiModalItem
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model code; the cache package alone should not have to.
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name == "LLMEngine":
        from .engine.llm_engine import LLMEngine

        return LLMEngine
    if name in ("BeamSearchOutput", "BeamSearchSequence"):  # vLLM's vllm.beam_search types
        from .engine import beam_output

        return getattr(beam_output, name)
    if name == "EngineArgs":
        from .engine_args import EngineArgs

        return EngineArgs
    raise AttributeError(name)


__all__ = [
    "LLM",
    "LLMEngine",
    "EngineArgs",
    "SamplingParams",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "RequestOutputKind",
    "TextPrompt",
    "TokensPrompt",
    "PromptType",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "LoRARequest",
    "MultiModalItem",
]
