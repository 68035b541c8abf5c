"""Engine configuration, with vLLM's argument names."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_KV_CACHE_BYTES = 1 << 30  # 1 GiB, like vLLM-CPU's VLLM_CPU_KVCACHE_SPACE default scale


@dataclass
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str | None = None  # None: cuda if available, else cpu
    max_model_len: int | None = None
    block_size: int = 16
    num_blocks: int | None = None  # KV budget in blocks; overrides kv_cache_memory_bytes
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256_cbor"
    enable_kv_cache_events: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
