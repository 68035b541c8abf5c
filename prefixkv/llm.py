"""The offline API, shaped like vLLM's: a script written for vLLM runs by changing the import."""
from __future__ import annotations

import logging
from typing import Any, Sequence

from .config import EngineConfig
from .engine.llm_engine import LLMEngine
from .outputs import RequestOutput
from .request import LoRARequest
from .sampling_params import SamplingParams

logger = logging.getLogger("prefixkv")

# vLLM arguments accepted for compatibility that have no meaning here.
_IGNORED_VLLM_ARGS = {
    "tokenizer_mode", "trust_remote_code", "tensor_parallel_size", "pipeline_parallel_size",
    "gpu_memory_utilization", "swap_space", "cpu_offload_gb", "enforce_eager", "quantization",
    "revision", "tokenizer_revision", "disable_custom_all_reduce", "disable_log_stats",
    "max_seq_len_to_capture", "compilation_config", "distributed_executor_backend",
    "enable_chunked_prefill", "download_dir", "load_format", "hf_overrides", "max_logprobs",
}


def _as_prompt_list(prompts: Any, prompt_token_ids: Any) -> list[str | list[int]]:
    if prompt_token_ids is not None:
        prompts = prompt_token_ids
    if prompts is None:
        raise ValueError("no prompts given")
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    elif isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        prompts = [list(prompts)]  # one prompt of token ids
    out: list[str | list[int]] = []
    for p in prompts:
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                p = list(p["prompt_token_ids"])
            elif "prompt" in p:
                p = p["prompt"]
            else:
                raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got {sorted(p)}")
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, Sequence) and all(isinstance(t, int) for t in p):
            out.append(list(p))
        else:
            raise ValueError(f"a prompt must be a string, a list of token ids or a dict; got {type(p).__name__}")
    if not out:
        raise ValueError("no prompts given")
    return out


class LLM:
    """LLM(model=None, enable_prefix_caching=True, ...): None loads the embedded SmolLM2-135M-Instruct.

    The KV budget is `kv_cache_memory_bytes` (or `num_blocks`, or vLLM's
    `num_gpu_blocks_override`), not the model's maximum length."""

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None, dtype: str = "auto",
                 max_model_len: int | None = None, block_size: int = 16, seed: int = 0,
                 enable_prefix_caching: bool = True, kv_cache_memory_bytes: int | None = None,
                 num_blocks: int | None = None, num_gpu_blocks_override: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 prefix_caching_hash_algo: str = "sha256_cbor", device: str | None = None,
                 **kwargs: Any) -> None:
        unknown = set(kwargs) - _IGNORED_VLLM_ARGS
        if unknown:
            raise TypeError(f"LLM() got unexpected arguments: {', '.join(sorted(unknown))}")
        if kwargs:
            logger.info("ignoring vLLM arguments with no meaning here: %s", ", ".join(sorted(kwargs)))
        if tokenizer is not None and tokenizer != model:
            raise ValueError("a separate tokenizer is not supported: the tokenizer comes with the model")
        config = EngineConfig(
            model=model, dtype=dtype, device=device, max_model_len=max_model_len, block_size=block_size,
            num_blocks=num_blocks if num_blocks is not None else num_gpu_blocks_override,
            kv_cache_memory_bytes=kv_cache_memory_bytes, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens or 2048,
            enable_prefix_caching=enable_prefix_caching, prefix_caching_hash_algo=prefix_caching_hash_algo,
            seed=seed)
        self.llm_engine = LLMEngine(config)

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """Wrap an existing engine (e.g. one sharing already loaded weights)."""
        llm = cls.__new__(cls)
        llm.llm_engine = engine
        return llm

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: Any = None, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | None = None, *,
                 prompt_token_ids: Any = None, cache_salt: str | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a batch (strings, token-id lists, or {"prompt": ...} /
        {"prompt_token_ids": ...} dicts). Everything is validated before anything runs."""
        items = _as_prompt_list(prompts, prompt_token_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(items)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(items):
                raise ValueError(f"{len(params_list)} sampling params for {len(items)} prompts")
        engine = self.llm_engine
        tokenized = [engine.tokenize(p) if isinstance(p, str) else p for p in items]
        for ids in tokenized:
            engine.validate_prompt(ids)
        ids_in_order = []
        for item, ids, params in zip(items, tokenized, params_list):
            ids_in_order.append(engine.add_request(
                ids, params, lora_request=lora_request, cache_salt=cache_salt,
                prompt_text=item if isinstance(item, str) else None))
        return self._run(ids_in_order, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, **kwargs: Any) -> list[RequestOutput]:
        """Chat completion for one conversation or a batch, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        prompts = [tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=False)
                   for conv in conversations]
        return self.generate([{"prompt_token_ids": tok.encode(p, add_special_tokens=False)} for p in prompts],
                             sampling_params, use_tqdm=use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(request_ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(request_ids) > 1:
            from tqdm import tqdm
            bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort_request(list(pending))  # an interrupt or a failure leaves no blocks held
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[r] for r in request_ids]

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def get_prefix_cache_stats(self):
        """Requests, queried tokens, hit tokens and hit rate since start."""
        return self.llm_engine.prefix_cache_stats


