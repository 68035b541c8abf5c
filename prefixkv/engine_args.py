"""EngineArgs: every engine option in one place, with vLLM's names and defaults.

The same dataclass generates the command line flags (`EngineArgs.add_cli_args(parser)` and
`EngineArgs.from_cli_args(namespace)`) and is what `LLM(...)` keywords are checked against, so a
default or a list of choices is written once. vLLM options that prefixkv does not implement are
fields too, with vLLM's defaults: a value that would change behaviour is refused with a ValueError
naming it; a value that changes nothing here is accepted and logged once (`_COMPAT`).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from .cache import HASH_ALGOS, POLICIES
from .kv_events.config import KVEventsConfig
from .reasoning import REASONING_PARSERS
from .sizes import parse_bytes
from .speculative.config import SpeculativeConfig
from .stage_outputs.pooling import parse_pooler_config

logger = logging.getLogger("prefixkv")

DEFAULT_KV_CACHE_BYTES = 1 << 30  # 1 GiB, like vLLM-CPU's VLLM_CPU_KVCACHE_SPACE default scale
# dtype name -> torch dtype attribute name; "auto" is float32 on CPU, bfloat16 on CUDA
DTYPES: dict[str, str | None] = {
    "auto": None,
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}
DEVICES = ("cpu", "cuda")
MODEL_HELP = (
    "model to load: an HF model folder (config.json, tokenizer.json, *.safetensors) or a .gguf "
    "file; omitted: the embedded SmolLM2-135M-Instruct"
)

MM_HASH_MODES = ("exact", "phash")  # prefixkv/multimodal/hashing.py
TIER_SECRET_ENV = "PREFIXKV_KV_TIER_SECRET"  # kv_tier_secret's default (prefixkv/tiers/value.py)
DEFAULT_MM_ENCODER_CACHE_BYTES = 128 << 20
# vLLM's --load-format values that name what prefixkv reads (the loader: prefixkv/model/loader.py)
LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf")
TASKS = ("auto", "generate", "embed")  # vLLM's older task= (superseded by runner=)
RUNNERS = ("auto", "generate", "pooling")  # vLLM's runner=; "draft" (speculative decoding) is refused


def parse_mm_limit(text: str) -> dict[str, int]:
    """--limit-mm-per-prompt: vLLM's JSON ('{"image": 2}') or image=2."""
    import json

    try:
        value = json.loads(text) if text.strip().startswith("{") else dict(_kv(p) for p in text.split(","))
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"not a limit: {text!r} (e.g. '{{\"image\": 2}}' or image=2)") from e
    return value


def parse_json_object(text: str) -> dict[str, Any]:
    """A flag whose value is a JSON object, as vLLM's dict-valued flags ('{"key": 1}')."""
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def parse_compilation_config(text: str) -> dict[str, Any] | int:
    """--compilation-config: an optimization level (3) or a JSON object, as vLLM."""
    return int(text) if text.strip().isdigit() else parse_json_object(text)


def _kv(pair: str) -> tuple[str, int]:
    key, value = pair.split("=", 1)
    return key.strip(), int(value)


def _opt(
    default: Any,
    help: str | None = None,
    *,
    type: Callable[[str], Any] | None = None,
    choices: Any = None,
    flag: str | None = None,
    cli: bool = True,
    repr: bool = True,
) -> Any:
    """A field with what its CLI flag needs (help None: no flag); `repr=False` keeps a secret out
    of the dataclass's repr (so out of logs and error messages)."""
    meta = {"help": help, "type": type, "choices": choices, "flag": flag, "cli": cli and help is not None}
    return field(default=default, metadata=meta, repr=repr)


def _compat(
    default: Any,
    accepts: Callable[[Any], bool],
    why: str,
    *,
    type: Callable[[str], Any] | None = None,
    cli: bool = True,
) -> Any:
    """A vLLM option prefixkv does not implement: `accepts(value)` says whether the value changes
    nothing here (accepted, logged); `why` is said either way."""
    meta = {
        "help": f"vLLM option; {why}" if cli else None,
        "type": type,
        "choices": None,
        "flag": None,
        "cli": cli,
        "compat": (accepts, why),
    }
    return field(default=default, metadata=meta)


def _is_default(default: Any) -> Callable[[Any], bool]:
    return lambda v: v == default or (default is None and v in ({}, "", ()))


def _anything(_v: Any) -> bool:
    return True


DEFAULT_KV_CACHE_METRICS_SAMPLE = 0.01  # vLLM's
# vLLM's; every one but NONE captures pure decode steps whole here, other steps eager (same outputs)
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


@dataclass
class EngineArgs:
    """Engine options, with vLLM's names and defaults. `EngineConfig` is the same class."""

    model: str | None = _opt(None, cli=False)  # None: the embedded SmolLM2-135M-Instruct GGUF
    tokenizer: str | None = _opt(
        None,
        "tokenizer to use instead of the model's: an HF folder (tokenizer.json, tokenizer_config.json) or a "
        ".gguf file; its vocabulary must fit the model's (default: the model's own)",
    )
    generation_config: str = _opt(
        "auto",
        "sampling defaults: auto reads the model folder's generation_config.json (temperature, top_p, top_k, "
        "min_p, repetition_penalty, max_new_tokens), as vLLM; vllm ignores it; a folder reads that folder's "
        "(default: auto)",
    )
    dtype: str = _opt(
        "auto",
        "weight and activation dtype; auto: float32 on CPU, bfloat16 on CUDA (default: auto)",
        choices=list(DTYPES),
    )
    device: str | None = _opt(None, "default: cuda if available, else cpu", choices=list(DEVICES))
    max_model_len: int | None = _opt(
        None, "longest sequence (prompt + output) in tokens; default: the model's, capped by the KV budget", type=int
    )
    block_size: int = _opt(16, "tokens per KV cache block (default: 16)", type=int)
    kv_cache_memory_bytes: int | None = _opt(
        None, "KV cache budget in bytes, e.g. 536870912, 512M, 2GiB (default: 1GiB)", type=parse_bytes
    )
    num_gpu_blocks_override: int | None = _opt(
        None, "KV cache budget in blocks; overrides --kv-cache-memory-bytes", type=int
    )
    num_blocks: int | None = _opt(None, cli=False)  # prefixkv's name for num_gpu_blocks_override
    gpu_memory_utilization: float | None = _opt(
        None,
        "CUDA: the fraction of the GPU's memory the engine may hold - weights, one step's activations "
        "(measured at start-up) and the KV cache, which gets the rest - as vLLM's (default: none; the KV "
        "budget is --kv-cache-memory-bytes). On a CPU it changes nothing (accepted and logged)",
        type=float,
    )
    enable_prefix_caching: bool = _opt(
        True, "reuse the KV blocks of identical prompt prefixes across requests (default: on)"
    )
    prefix_caching_hash_algo: str | Callable[[Any], bytes] = _opt(  # noqa: RUF009 (it returns a field)
        "sha256_cbor",
        "content hash naming cached blocks to the outside (KV events); lookups never depend on it, they compare "
        "exact keys. vLLM's choices; the default differs: sha256_cbor here (reproducible across processes and "
        "languages), vLLM's default is sha256 (over pickle) (default: sha256_cbor)",
        choices=list(HASH_ALGOS),
    )
    eviction_policy: str = _opt(
        "lru",
        "which free cached block is reused first (default: lru, as vLLM; see docs/replay.md)",
        choices=list(POLICIES),
    )
    disable_hybrid_kv_cache_manager: bool = _opt(
        False,
        "keep every layer's K/V in one block per position for models that mix full and sliding-window "
        "attention, instead of a KV-cache group per layer kind that frees blocks out of the window "
        "(default: groups on; vLLM's flag)",
    )
    enable_kv_cache_events: bool = _opt(
        False, "record BlockStored / BlockRemoved / AllBlocksCleared events for a publisher (default: off)"
    )
    max_pinned_fraction: float = _opt(
        0.5,
        "share of the KV cache's blocks that pinned prefixes may hold (LLM.pin_prefix, POST /v1/cache/pin); a "
        "pin past it is refused with an error naming this option (default: 0.5)",
        type=float,
    )
    pinned_prefixes_file: str | None = _opt(
        None,
        "a JSON file the pinned prefixes are written to after each pin and unpin, and pinned again from at start "
        "(their blocks read from a KV tier where one holds them, else computed); default: pins end with the process",
    )
    kv_cache_metrics: bool = _opt(
        False,
        "sampled KV block residency metrics, as vLLM's: vllm:kv_block_lifetime_seconds, "
        "vllm:kv_block_idle_before_evict_seconds, vllm:kv_block_reuse_gap_seconds, plus the reuse distance in "
        "blocks and evictions by cause (default: off)",
    )
    kv_cache_metrics_sample: float = _opt(
        DEFAULT_KV_CACHE_METRICS_SAMPLE,
        "share of the KV blocks the residency metrics follow (default: 0.01, as vLLM)",
        type=float,
    )
    kv_events_config: KVEventsConfig | dict[str, Any] | str | None = _opt(  # noqa: RUF009 (it returns a field)
        None,
        "publish KV events as vLLM does, a JSON object of vLLM's KVEventsConfig, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"}\' '
        "(docs/kv_events.md; default: none)",
    )
    enable_stage_output_cache: bool = _opt(
        False,
        "keep the final hidden states of cached blocks (CPU, in the same budget as the KV), so prompt logprobs "
        "and embeddings (MEAN / ALL pooling included) reuse a cached prefix (default: off)",
    )
    kv_offloading_size: float | None = _opt(
        None,
        "CPU-memory KV tier below the pool, in GiB (vLLM's flag): blocks computed once are kept there and "
        "loaded back when the pool has evicted them (default: off; docs/tiers.md)",
        type=float,
    )
    kv_tier: list[str] | str | None = _opt(
        None,
        "a disk or Redis KV tier below the pool and the CPU tier: disk:/path[?size=16GiB] or "
        "redis://host:port/db[?timeout=0.5]; repeat the flag or give a comma list; an engine started "
        "against the same tier serves known prefixes from it (default: none; docs/tiers.md)",
    )
    kv_tier_secret: str | bytes | None = _opt(  # noqa: RUF009 (it returns a field)
        None,
        "a secret that authenticates the disk and Redis tiers' values: each carries an HMAC-SHA256 under it, "
        "and a value without a valid one is refused (a miss); engines share blocks only with the same secret. "
        f"Prefer ${TIER_SECRET_ENV} (a flag is visible in the process list) (default: ${TIER_SECRET_ENV}, else "
        "none: values are checksummed against corruption, not authenticated; docs/tiers.md)",
        repr=False,
    )
    pooler_config: dict[str, Any] | str | None = _opt(  # noqa: RUF009 (it returns a field)
        None,
        'default pooling of embeddings, as vLLM: \'{"pooling_type": "MEAN", "normalize": false}\' '
        "(pooling_type LAST, MEAN, CLS or ALL; default: LAST, normalized)",
    )
    max_num_seqs: int = _opt(256, "most sequences in one batch (default: 256)", type=int)
    max_num_batched_tokens: int = _opt(
        2048, "most tokens computed in one step; longer prompts are prefilled in chunks (default: 2048)", type=int
    )
    enforce_eager: bool = _opt(
        False,
        "never capture CUDA graphs: every step runs eagerly (default: on a GPU with Triton, decode steps "
        "of up to 512 sequences are captured once per batch size and replayed; a CPU is always eager)",
    )
    async_scheduling: bool | None = _opt(
        None,
        "schedule each decode step while the previous one runs, as vLLM: its tokens go from one step to "
        "the next on the device and the host books a step while the device computes the next; a sequence "
        "that stops on a token has one more computed and dropped. Prompt logprobs, hidden states, "
        "penalties and constraints (grammars included) run ahead, so do steps saving to or loading from "
        "the KV tiers and with the stage-output cache (its rows written when a step is booked). Greedy and seeded "
        "outputs are the same either way (default: on a GPU, where it took 0.71-0.95x the in-order "
        "step's time on an H100; off on a CPU, which computes at launch and gains nothing)",
    )
    speculative_config: SpeculativeConfig | dict[str, Any] | None = _opt(  # noqa: RUF009 (it returns a field)
        None,
        'speculative decoding, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}\' proposes the tokens that followed the latest earlier occurrence of a '
        "sequence's last n tokens (in its prompt or output), and one step verifies them; outputs are the same "
        "as without (greedy and seeded ones token for token). A request gets the drafts that raise a step's "
        "expected tokens per second, by the step times this machine measures and its share of drafts kept "
        '("by_measured_cost": false proposes every draft, as vLLM). Optional: disable_by_batch_size. Other '
        "methods (draft models, EAGLE, MTP) are not implemented; recurrent models refuse it (default: off)",
        type=parse_json_object,
    )
    max_seq_len_to_capture: int = _opt(
        8192, "longest context a captured decode step reads; longer ones run eagerly (default: 8192)", type=int
    )
    compilation_config: dict[str, Any] | int | None = _opt(  # noqa: RUF009 (it returns a field)
        None,
        "vLLM's: a level (nothing is compiled here) or JSON; read: cudagraph_capture_sizes (the decode batch "
        "sizes, and mixed steps' token counts), max_capture_size, cudagraph_mode (NONE: no graphs; FULL or "
        "FULL_AND_PIECEWISE: mixed steps captured too, each whole; FULL_DECODE_ONLY: decode steps only; "
        "default: decode steps, and mixed steps up to the token count where their replay timed faster than "
        "the eager step on this GPU, measured once per GPU and model shape); other keys change nothing",
        type=parse_compilation_config,
    )
    scheduling_policy: str = _opt(
        "fcfs",
        "fcfs: first come first served; priority: by each request's `priority` (lower first, then arrival), "
        "preempting the largest (priority, arrival) among running requests not yet scheduled in the step "
        "(default: fcfs, as vLLM)",
        choices=["fcfs", "priority"],
    )
    cpu_thread_policy: str = _opt(
        "adaptive",
        "CPU only: adaptive measures the CPU time other processes take on this process's cores and runs short "
        "steps (decode) on the cores they leave free while they do, on the configured count otherwise; "
        "fixed always runs on the configured count (torch's, OMP_NUM_THREADS). Outputs are the same either "
        "way (default: adaptive)",
        choices=["adaptive", "fixed"],
    )
    max_logprobs: int = _opt(
        20, "most logprobs / prompt_logprobs a request may ask for (default: 20, as vLLM)", type=int
    )
    seed: int | None = _opt(0, "seed of the default sampling generator (default: 0)", type=int)
    enable_lora: bool = _opt(False, "serve PEFT LoRA adapters (LoRARequest / --lora-modules) (default: off)")
    max_loras: int = _opt(1, "most LoRA adapters in one batch, resident on the device (default: 1)", type=int)
    max_lora_rank: int = _opt(16, "highest LoRA rank accepted (default: 16)", type=int)
    structured_outputs_backend: str = _opt(
        "auto",
        "grammar engine of structured outputs: xgrammar (the xgrammar extra), guidance (llguidance, always "
        "installed) or auto (xgrammar when installed, else guidance) (default: auto)",
        choices=["auto", "xgrammar", "guidance"],
    )
    stream_interval: int = _opt(
        1,
        "tokens a streamed request gathers before its next output: the first and the last come at once "
        "(vLLM's; a request's own stream_interval may raise it) (default: 1)",
        type=int,
    )
    reasoning_parser: str | None = _opt(
        None,
        "where a thinking model's reasoning ends (prefixkv/reasoning.py): chat replies carry it apart as "
        "`reasoning`, and structured outputs constrain only the answer after it: deepseek_r1 (<think> ... "
        "</think>), deepseek_v3 (the same, only when the template is told to think), qwen3 (enable_thinking=False "
        "answers at once), glm45 / glm47, minimax_m2, openai_gptoss (gpt-oss's harmony channels) (default: none)",
        choices=sorted(REASONING_PARSERS),
    )
    # Multimodal (vision-language checkpoints; docs/multimodal.md)
    mm_hash: str = _opt(
        "exact",
        "identity of an image for the prefix and encoder caches: exact (hash of the preprocessed pixels) or phash "
        "(perceptual: near-identical copies share entries and may change outputs) (default: exact)",
        choices=list(MM_HASH_MODES),
    )
    enable_mm_encoder_cache: bool = _opt(
        True, "keep image encoder outputs by image identity, so an image is encoded once (default: on)"
    )
    mm_encoder_cache_bytes: int = _opt(
        DEFAULT_MM_ENCODER_CACHE_BYTES, "encoder cache budget in bytes, LRU (default: 128MiB)", type=parse_bytes
    )
    limit_mm_per_prompt: dict[str, int] | None = _opt(  # noqa: RUF009 (it returns a field)
        None, "most images per prompt, e.g. '{\"image\": 2}' (default: no limit but the context)", type=parse_mm_limit
    )
    allowed_local_media_path: str | None = _opt(
        None, "image_url parts may name local files (file:// URLs) under this folder (default: none may)"
    )

    # Where weights come from: vLLM's names. prefixkv reads local files only (no download).
    load_format: str = _opt(
        "auto",
        "how the weights are read: auto (an HF folder's *.safetensors, else its pytorch_model*.bin; a .gguf file), "
        "safetensors, pt (an HF folder holding those files) or gguf (a .gguf file); a format the model does not "
        "have is refused (default: auto)",
        choices=list(LOAD_FORMATS),
    )

    # -- vLLM options prefixkv does not implement: refused unless they change nothing ----------
    tokenizer_mode: str = _compat(
        "auto", _is_default("auto"), "only 'auto': the model's own tokenizer (tokenizer.json or the GGUF's)"
    )
    trust_remote_code: bool = _compat(False, _anything, "no model code is ever downloaded or run")
    download_dir: str | None = _compat(None, _anything, "models are read from local files only")
    revision: str | None = _compat(None, _is_default(None), "models are read from local files only")
    tokenizer_revision: str | None = _compat(None, _is_default(None), "models are read from local files only")
    code_revision: str | None = _compat(None, _is_default(None), "no model code is ever run")
    hf_overrides: dict[str, Any] | None = _compat(  # noqa: RUF009 (it returns a field)
        None, _is_default(None), "model configs are used as written", type=parse_json_object
    )
    quantization: str | None = _compat(None, _is_default(None), "weights are not quantized (not implemented)")
    kv_cache_dtype: str = _compat("auto", _is_default("auto"), "the KV cache uses the model dtype")
    tensor_parallel_size: int = _compat(1, _is_default(1), "one device only (no tensor parallelism)", type=int)
    pipeline_parallel_size: int = _compat(1, _is_default(1), "one device only (no pipeline parallelism)", type=int)
    data_parallel_size: int = _compat(1, _is_default(1), "one engine per process (no data parallelism)", type=int)
    distributed_executor_backend: str | None = _compat(None, _anything, "one process, no executor")
    disable_custom_all_reduce: bool = _compat(False, _anything, "one device, no all-reduce")
    swap_space: float = _compat(4, _anything, "preemption recomputes, nothing is swapped", type=float)
    cpu_offload_gb: float = _compat(0, _is_default(0), "weights are not offloaded (not implemented)", type=float)
    # the server's --disable-log-stats (server/launch.py) is this option's flag: it turns off the
    # server's periodic stats line, which is all it means
    disable_log_stats: bool = _compat(
        False, _anything, "LLM logs no periodic stats (the server: --disable-log-stats)", cli=False
    )
    disable_async_output_proc: bool = _compat(False, _anything, "outputs are processed in the step")
    enable_chunked_prefill: bool | None = _compat(
        None, lambda v: v is None or v is True, "chunked prefill is always on (False is not implemented)"
    )
    mm_processor_kwargs: dict[str, Any] | None = _compat(  # noqa: RUF009 (it returns a field)
        None, _is_default(None), "the checkpoint's own image processor settings are used", type=parse_json_object
    )
    disable_sliding_window: bool = _compat(
        False, _is_default(False), "sliding windows are applied as the model config says"
    )
    kv_sharing_fast_prefill: bool = _compat(
        False, _anything, "layers that read earlier layers' K/V (Gemma 4) always run the sampled rows alone (exact)"
    )
    task: str = _compat(
        "auto",
        lambda v: v in TASKS,
        "one engine both generates and embeds (LLM.embed / LLM.encode); no other task",
    )
    runner: str = _compat(
        "auto",
        lambda v: v in RUNNERS,
        "one engine both generates and pools (generate, auto and pooling all load it); no draft runner",
    )

    def __post_init__(self) -> None:
        self._check_compat()
        self.kv_events_config = KVEventsConfig.parse(self.kv_events_config)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.kv_events_config is not None and self.kv_events_config.enable_kv_cache_events:
            self.enable_kv_cache_events = True  # vLLM's switch lives in the config
        if self.max_num_batched_tokens is None:  # vLLM's None: the default
            self.max_num_batched_tokens = 2048
        if self.num_gpu_blocks_override is not None:
            if self.num_blocks is not None and self.num_blocks != self.num_gpu_blocks_override:
                raise ValueError(
                    f"num_blocks={self.num_blocks} and num_gpu_blocks_override="
                    f"{self.num_gpu_blocks_override} disagree; give one"
                )
            self.num_blocks = self.num_gpu_blocks_override
        if self.gpu_memory_utilization is not None:
            u = self.gpu_memory_utilization
            if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
                raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {u!r}")
            for other in ("kv_cache_memory_bytes", "num_blocks"):
                if getattr(self, other) is not None:
                    raise ValueError(f"give one of gpu_memory_utilization and {other}: both size the KV cache")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose {', '.join(DTYPES)}")
        if self.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", str(self.device)):
            raise ValueError(f"unknown device {self.device!r}; choose cpu or cuda")
        for name, low in (
            ("block_size", 1),
            ("max_num_seqs", 1),
            ("max_num_batched_tokens", 1),
            ("max_logprobs", 0),
            ("num_blocks", 1),
            ("kv_cache_memory_bytes", 1),
            ("max_model_len", 2),
            ("max_loras", 1),
            ("max_lora_rank", 1),
            ("max_seq_len_to_capture", 1),
            ("stream_interval", 1),
        ):
            value = getattr(self, name)
            if value is None and name in ("num_blocks", "kv_cache_memory_bytes", "max_model_len"):
                continue
            if not _is_int(value) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.seed is not None and not _is_int(self.seed):  # None: a random seed, as in vLLM
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.prefix_caching_hash_algo, str) and self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(
                f"unknown prefix_caching_hash_algo {self.prefix_caching_hash_algo!r}; "
                f"choose one of {', '.join(HASH_ALGOS)}"
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling_policy {self.scheduling_policy!r}; choose fcfs or priority")
        if self.cpu_thread_policy not in ("adaptive", "fixed"):
            raise ValueError(f"unknown cpu_thread_policy {self.cpu_thread_policy!r}; choose adaptive or fixed")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}")
        self._check_compilation_config()
        self._check_multimodal()
        self._check_load_format()
        self.default_pooling = parse_pooler_config(self.pooler_config)
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ValueError(f"max_pinned_fraction must be in [0, 1], got {self.max_pinned_fraction}")
        if not 0.0 < self.kv_cache_metrics_sample <= 1.0:
            raise ValueError(f"kv_cache_metrics_sample must be in (0, 1], got {self.kv_cache_metrics_sample}")
        if self.kv_cache_metrics_sample != DEFAULT_KV_CACHE_METRICS_SAMPLE and not self.kv_cache_metrics:
            raise ValueError("kv_cache_metrics_sample (--kv-cache-metrics-sample) needs kv_cache_metrics on")
        if isinstance(self.eviction_policy, str) and self.eviction_policy not in POLICIES:
            raise ValueError(f"unknown eviction_policy {self.eviction_policy!r}; choose one of {', '.join(POLICIES)}")
        self._check_tiers()

    def _check_compilation_config(self) -> None:
        """What of vLLM's compilation_config means something here: the CUDA graphs' sizes and
        mode; a level or any other key is accepted and logged (nothing is compiled)."""
        cc = self.compilation_config
        if cc is None:
            return
        if not isinstance(cc, dict):
            if not _is_int(cc):
                raise ValueError(f"compilation_config must be a level or a dict, got {cc!r}")
            _log_once(f"compilation_config={cc!r}: nothing is compiled here")
            return
        sizes = cc.get("cudagraph_capture_sizes")
        if sizes is not None and (not isinstance(sizes, list) or not all(_is_int(x) and x > 0 for x in sizes)):
            raise ValueError(f"compilation_config cudagraph_capture_sizes must be positive integers, got {sizes!r}")
        cap = cc.get("max_capture_size")
        if cap is not None and (not _is_int(cap) or cap < 1):
            raise ValueError(f"compilation_config max_capture_size must be a positive integer, got {cap!r}")
        mode = cc.get("cudagraph_mode")
        if mode is not None and str(mode).upper() not in CUDAGRAPH_MODES:
            raise ValueError(f"compilation_config cudagraph_mode {mode!r}: choose one of {', '.join(CUDAGRAPH_MODES)}")
        others = sorted(set(cc) - {"cudagraph_capture_sizes", "max_capture_size", "cudagraph_mode"})
        if others:
            _log_once(f"compilation_config {', '.join(others)}: nothing is compiled here")
        if mode is not None and str(mode).upper() in ("PIECEWISE", "FULL", "FULL_AND_PIECEWISE"):
            _log_once(f"compilation_config cudagraph_mode={mode}: decode and mixed steps are each captured whole")
        elif mode is not None and str(mode).upper() == "FULL_DECODE_ONLY":
            _log_once(f"compilation_config cudagraph_mode={mode}: decode steps are captured, others run eagerly")

    def _check_tiers(self) -> None:
        from .tiers import parse_spec, split_specs

        size = self.kv_offloading_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0):
            raise ValueError(f"kv_offloading_size must be a positive number of GiB, got {size!r}")
        specs = split_specs(self.kv_tier)
        for text in specs:
            parse_spec(text)
        if (size or specs) and not self.enable_prefix_caching:
            raise ValueError("KV tiers (kv_offloading_size / kv_tier) need enable_prefix_caching")
        secret = self.kv_tier_secret
        if secret is not None:
            # the value is never put in a message: it is a secret
            if not isinstance(secret, (str, bytes)) or not secret:
                raise ValueError(f"kv_tier_secret must be a non-empty string or bytes, got a {type(secret).__name__}")
            if not (size or specs):
                raise ValueError(
                    "kv_tier_secret authenticates KV tier values: give it with kv_tier or kv_offloading_size"
                )
        elif (size or specs) and os.environ.get(TIER_SECRET_ENV):
            # the environment applies to every engine started in it: taken where there are tiers
            # (said once in the log, by name only), ignored by an engine without them
            self.kv_tier_secret = os.environ[TIER_SECRET_ENV]
            _log_once(f"KV tier values authenticated with the secret from ${TIER_SECRET_ENV}")

    def tier_secret_bytes(self) -> bytes | None:
        """The KV tier secret as bytes (a string as UTF-8), or None."""
        secret = self.kv_tier_secret
        if secret is None:
            return None
        return secret.encode() if isinstance(secret, str) else bytes(secret)

    def _check_multimodal(self) -> None:
        if self.mm_hash not in MM_HASH_MODES:
            raise ValueError(f"unknown mm_hash {self.mm_hash!r}; choose one of {', '.join(MM_HASH_MODES)}")
        if not _is_int(self.mm_encoder_cache_bytes) or self.mm_encoder_cache_bytes < 0:
            raise ValueError(f"mm_encoder_cache_bytes must be an integer >= 0, got {self.mm_encoder_cache_bytes!r}")
        limit = self.limit_mm_per_prompt
        if limit is not None:
            if not isinstance(limit, dict):
                raise ValueError(f"limit_mm_per_prompt must be a dict such as {{'image': 2}}, got {limit!r}")
            for key, value in limit.items():
                if key != "image":
                    raise ValueError(f"limit_mm_per_prompt[{key!r}]: only images are supported")
                if not _is_int(value) or value < 0:
                    raise ValueError(f"limit_mm_per_prompt['image'] must be an integer >= 0, got {value!r}")
        path = self.allowed_local_media_path
        if path is not None and not isinstance(path, str):
            raise ValueError(f"allowed_local_media_path must be a folder path, got {path!r}")

    def _check_load_format(self) -> None:
        """load_format other than auto must name the weights the model has: a value prefixkv
        cannot honour is refused, never ignored."""
        fmt = self.load_format
        if fmt == "auto":
            return
        if fmt not in LOAD_FORMATS:
            raise ValueError(
                f"load_format={fmt!r} is not supported by prefixkv: choose one of {', '.join(LOAD_FORMATS)}"
            )
        found = weights_format(self.model)
        if found is not None and found != fmt:
            what = "the embedded SmolLM2-135M-Instruct" if self.model is None else repr(self.model)
            raise ValueError(f"load_format={fmt!r} does not match {what}: its weights are {found}")

    def _check_compat(self) -> None:
        accepted = []
        for f in fields(self):
            compat = f.metadata.get("compat")
            if compat is None:
                continue
            value = getattr(self, f.name)
            if value is f.default or (type(value) is type(f.default) and value == f.default):
                continue
            accepts, why = compat
            if not accepts(value):
                raise ValueError(f"{f.name}={value!r} is not supported by prefixkv: {why}")
            accepted.append(f"{f.name}={value!r} ({why})")
        if accepted:
            _log_once("accepted vLLM options that change nothing here: " + "; ".join(accepted))

    # -- the two front ends ----------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, positional_model: bool = True) -> None:
        """The engine's flags, vLLM's names: `--block-size` for block_size, and so on."""
        g = parser.add_argument_group("model and engine (vLLM's flag names)")
        if positional_model:
            g.add_argument("model_tag", nargs="?", metavar="MODEL", default=None, help=MODEL_HELP)
        g.add_argument("--model", dest="model_flag", default=None, help="same as the MODEL argument")
        compat = parser.add_argument_group("vLLM options accepted only where they change nothing here")
        for f in fields(cls):
            meta = f.metadata
            if not meta.get("cli"):
                continue
            group = compat if "compat" in meta else g
            flag = meta["flag"] or "--" + f.name.replace("_", "-")
            kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": meta["help"]}
            if isinstance(f.default, bool) or f.name in ("enable_chunked_prefill", "async_scheduling"):
                kwargs["action"] = argparse.BooleanOptionalAction
            elif f.name == "kv_tier":  # repeatable
                kwargs["action"] = "append"
            else:
                if meta["type"] is not None:
                    kwargs["type"] = meta["type"]
                if meta["choices"] is not None:
                    kwargs["choices"] = meta["choices"]
            group.add_argument(flag, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.metadata.get("cli") and hasattr(args, f.name):
                values[f.name] = getattr(args, f.name)
        values["model"] = getattr(args, "model_tag", None) or getattr(args, "model_flag", None)
        return cls(**values)

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> EngineArgs:
        """`LLM(model, **kwargs)`: unknown names are a TypeError, as a Python call's would be."""
        unknown = sorted(set(kwargs) - cls.field_names())
        if unknown:
            raise TypeError(f"LLM() got unexpected arguments: {', '.join(unknown)}")
        return cls(model=model, **kwargs)


def weights_format(model: str | None) -> str | None:
    """What the loader reads for `model` (None: the embedded GGUF): gguf, safetensors or pt, as
    prefixkv/model/loader.py chooses; None when the path names nothing (the loader then says so)."""
    import glob

    from .model.tokenizer_loader import resolve_hub_id

    if model is None:
        return "gguf"
    path = os.path.expanduser(str(model))
    if not os.path.exists(path):
        path = resolve_hub_id(str(model)) or path
    if os.path.isfile(path):
        return "gguf"
    if not os.path.isdir(path):
        return None
    if not os.path.isfile(os.path.join(path, "config.json")) and glob.glob(os.path.join(path, "*.gguf")):
        return "gguf"
    if glob.glob(os.path.join(path, "*.safetensors")):
        return "safetensors"
    if glob.glob(os.path.join(path, "pytorch_model*.bin")):
        return "pt"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.info(message)
