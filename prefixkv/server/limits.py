"""Per-request limits of the server (no heavy imports: the CLI reads the defaults for --help)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestLimits:
    """Per-request caps that keep one client from taking the server (see `prefixkv serve --help`)."""

    max_n: int = 128  # sequences sampled per prompt (OpenAI's own cap)
    max_prompts: int = 256  # prompts in one /v1/completions request
    max_logprobs: int = 20  # logprobs / top_logprobs / prompt_logprobs (vLLM's default)
    require_cache_salt: bool = False  # multi-tenant: every request names its tenant's salt
