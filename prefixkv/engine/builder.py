"""Builds every part of an engine once and hands each its collaborators through its constructor.

Order matters where one part measures another: the CPU kernels compile before the thread policy's
first window opens (the compiler's CPU time would read as a neighbour's); the thread policy starts
before the model loads (its first window spans the loading); every per-block tensor is registered
before the KV budget is divided among them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..cache import ResidencyMetrics, get_hash_function, none_hash
from ..engine_args import DEFAULT_KV_CACHE_BYTES, EngineArgs
from ..kv_events import EventPublisher, KVEventsConfig, create_publisher
from ..lora.manager import LoRAManager
from ..memory.block_tensors import BlockTensors, kv_cache_specs
from ..memory.kv_groups import KVCacheGroups, plan_kv_groups
from ..model import LlamaModel, LoadedModel, ModelConfig, load_model
from ..model.generation_config import sampling_defaults
from ..model.tokenizer import Tokenizer
from ..model.warmup import KERNELS_BUILD, prepare_cpu_kernels
from ..progress import Stages
from ..speculative import DraftBudget, SpeculativeConfig
from ..stage_outputs import stage_output_specs
from ..tiers import TierManager, build_kv_connector
from ..tiers.transfer import STAGE_BYTES
from . import graph_check, mixed_graph_choice
from .cpu_threads import AdaptiveCpuThreads, thread_counts_agree
from .cuda_graphs import StepGraphs, capture_sizes, graph_mode, mixed_capture_sizes, tail_rows
from .device import resolve_device_dtype
from .gpu_memory import cuda_kv_budget
from .input_processor import InputProcessor
from .model_runner import ModelRunner
from .scheduler import Scheduler

if TYPE_CHECKING:
    from ..multimodal import EncoderCache, MultiModalInputProcessor

logger = logging.getLogger("prefixkv")


@dataclass
class EngineParts:
    """What an engine is made of, each part already wired to its collaborators."""

    config: EngineArgs
    device: torch.device
    dtype: torch.dtype
    loaded: LoadedModel
    tokenizer: Tokenizer
    default_sampling_params: dict[str, Any]  # the model creator's (generation_config.json)
    block_tensors: BlockTensors
    num_blocks: int
    max_model_len: int
    scheduler: Scheduler
    runner: ModelRunner
    tiers: TierManager | None  # KV tiers below the pool (prefixkv/tiers), for their counters
    lora_manager: LoRAManager | None
    cpu_threads: AdaptiveCpuThreads | None  # thread count per step under CPU contention; None: fixed
    mm_processor: MultiModalInputProcessor | None  # None: a text-only model
    encoder_cache: EncoderCache | None
    kv_event_publisher: EventPublisher | None  # None: events wait in the engine for take_kv_events()
    input_processor: InputProcessor
    async_scheduling: bool  # decode steps scheduled while the previous one runs (llm_engine.py)


def build_engine(config: EngineArgs, loaded: LoadedModel | None = None) -> EngineParts:
    device, dtype = resolve_device_dtype(config, loaded)
    stages = Stages(logger)  # each stage timed, announced when slow (progress.py), one line when ready
    cpu_threads = _cpu_thread_policy(config, device, stages)
    if loaded is None:
        with stages.stage("model", f"loading {config.model or 'the embedded SmolLM2-135M-Instruct'}"):
            loaded = load_model(config.model, dtype=dtype, device=device)
    tokenizer = loaded.tokenizer
    if config.tokenizer is not None and config.tokenizer != config.model:
        tokenizer = _separate_tokenizer(config.tokenizer, loaded.config.vocab_size)
    model_config = loaded.config
    if model_config.is_recurrent:
        _refuse_for_recurrent(config, model_config.architecture)
    if model_config.is_mla and config.enable_lora:
        raise ValueError(
            f"enable_lora cannot be used with {model_config.architecture}: LoRA adapts the q/k/v and output "
            "projections, and multi-head latent attention has none of them (its latent projections are not adapted)"
        )
    if config.enable_lora and (model_config.per_layer_input_size or not model_config.uniform_kv_layers):
        raise ValueError(
            f"enable_lora cannot be used with {model_config.architecture}: adapters are built for one q/k/v shape "
            "in every layer, and its layers have two head sizes, no K/V projections or per-layer inputs"
        )
    speculative = SpeculativeConfig.parse(config.speculative_config)
    if speculative is not None:
        _check_speculative(config, model_config)
    bs = config.block_size
    kv_groups = _kv_groups(config, model_config)
    block_tensors = BlockTensors(kv_cache_specs(model_config, bs, dtype, kv_groups))
    if config.enable_stage_output_cache:  # the hidden states of cached blocks, in the same budget
        for spec in stage_output_specs(model_config, bs, dtype):
            block_tensors.register(spec)
    mode = _graph_mode(config, device, loaded)
    sizes = capture_sizes(config.max_num_seqs, config.compilation_config) if mode else []
    mixed_policy = mixed_graph_choice.policy(mode, config.compilation_config)
    if mode is None and os.environ.get(mixed_graph_choice.ENV, "").strip():
        logger.info("%s changes nothing here: every step runs eagerly", mixed_graph_choice.ENV)
    mixed_sizes = []
    stored_choice, stored_limit = None, None
    if mixed_policy != "none":
        mixed_sizes = mixed_capture_sizes(config.max_num_batched_tokens, config.compilation_config)
    if mixed_policy == "measured":  # captured only up to where a replay won before, once measured
        widths = (config.max_seq_len_to_capture, config.max_model_len)
        stored_choice = mixed_graph_choice.StoredChoice(
            device, model_config, dtype, bs, config.max_num_seqs, mixed_sizes, widths
        )
        stored_limit = stored_choice.read()
        if stored_limit is not None:
            mixed_sizes = [s for s in mixed_sizes if s <= stored_limit]
    graph_rows = max([*sizes, *mixed_sizes], default=0) if mode == "capture" else 0
    graph_logits_rows = tail_rows(sizes, loaded.config.vocab_size) if mode == "capture" else 0
    num_blocks = _num_blocks(config, device, loaded, block_tensors, graph_rows, graph_logits_rows)
    if mode and config.num_blocks is None and num_blocks > 1:
        num_blocks -= 1  # the graphs' null block comes out of a byte budget (a given count stays the pool's)
    max_model_len = _max_model_len(config, model_config, num_blocks, kv_groups)
    with stages.stage("KV cache", f"allocating the KV cache ({num_blocks} blocks)"):
        # with graphs, one more block than the scheduler's: where padding rows write (never read)
        block_tensors.allocate(num_blocks + (1 if mode else 0), device)
    graphs = None
    if mode:
        max_blocks = -(-min(config.max_seq_len_to_capture, max_model_len) // bs)
        caches = block_tensors.layer_caches(model_config, bs, kv_groups)
        graphs = StepGraphs(
            loaded.model, caches, sizes, max_blocks, bs, num_blocks, device, mode, max_model_len,
            mixed_sizes=mixed_sizes, max_seqs=config.max_num_seqs,
            lora=(config.max_loras, config.max_lora_rank) if config.enable_lora else None,
            layer_groups=kv_groups.layer_group(model_config.num_hidden_layers) if kv_groups is not None else None,
            recurrent=model_config.is_recurrent, image_rows=loaded.multimodal is not None,
        )  # fmt: skip
    # one hash function for the scheduler's cache and the tiers' namespace (an xxhash one is seeded per process)
    hash_fn = get_hash_function(config.prefix_caching_hash_algo)
    kv_connector = build_kv_connector(
        config, block_tensors, loaded, tokenizer, dtype=dtype, device=device, root_hash=none_hash(hash_fn)
    )
    scheduler = Scheduler(
        num_blocks=num_blocks,
        block_size=bs,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_caching=config.enable_prefix_caching,
        hash_algo=hash_fn,
        eviction_policy=config.eviction_policy,
        enable_kv_cache_events=config.enable_kv_cache_events,
        max_pinned_fraction=config.max_pinned_fraction,
        residency=ResidencyMetrics(config.kv_cache_metrics_sample) if config.kv_cache_metrics else None,
        max_loras=config.max_loras if config.enable_lora else None,
        policy=config.scheduling_policy,
        kv_connector=kv_connector.scheduler,
        stage_output_tensors=block_tensors if config.enable_stage_output_cache else None,
        kv_group_windows=kv_groups.later_windows if kv_groups is not None else (),
        kv_group_kind=_group_kind(model_config),
        drafter=speculative.drafter(max_model_len) if speculative is not None else None,
        draft_budget=DraftBudget() if speculative is not None and speculative.by_measured_cost else None,
    )
    lora_manager = None
    if config.enable_lora:
        lora_manager = LoRAManager(
            model_config, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank, dtype=dtype, device=device
        )
    mm_processor, encoder_cache, embedder = None, None, None
    if loaded.multimodal is not None:  # a vision-language checkpoint (prefixkv/multimodal/)
        from ..multimodal import EncoderCache, MultiModalEmbedder, MultiModalInputProcessor

        mm = loaded.multimodal
        limit = (config.limit_mm_per_prompt or {}).get("image")
        mm_processor = MultiModalInputProcessor(mm, config.mm_hash, limit)
        encoder_cache = EncoderCache(config.mm_encoder_cache_bytes if config.enable_mm_encoder_cache else 0)
        embedder = MultiModalEmbedder(mm.encoder, encoder_cache)
    async_scheduling = _async_scheduling(config, device) and speculative is None
    on_cpu = device.type == "cpu"
    layout = "laying the weights out for the CPU's kernels" if on_cpu else "building the model runner"
    with stages.stage("weight layout" if on_cpu else "runner", layout):
        runner = ModelRunner(
            loaded,
            block_tensors,
            dtype,
            device,
            _default_generator(config.seed),
            lora_manager,
            kv_connector=kv_connector.worker,
            stage_outputs=scheduler.stage_outputs,
            mm=embedder,
            block_size=bs,
            kv_groups=kv_groups,
            graphs=graphs,
            defer_reads=async_scheduling,
        )
    if graphs is not None:  # after the runner: LoRA's wrappers are in the model then
        what = f"capturing decode steps of {len(sizes)} batch sizes and mixed steps of {len(mixed_sizes)} token counts"
        with stages.stage("CUDA graphs", what):
            graphs.capture()
            graph_check.check_decode(graphs, runner, num_blocks, config.max_num_batched_tokens, dtype)
        if stored_choice is not None:
            mixed_graph_choice.choose(graphs, runner, stored_choice, stored_limit, num_blocks, dtype, stages)
    cpu_threads = _checked_thread_policy(cpu_threads, runner, dtype, stages)
    kv_events_config = config.kv_events_config
    assert kv_events_config is None or isinstance(kv_events_config, KVEventsConfig)  # EngineArgs parsed it
    parts = EngineParts(
        config=config,
        device=device,
        dtype=dtype,
        loaded=loaded,
        tokenizer=tokenizer,
        # the model creator's sampling defaults (generation_config.json), as vLLM's --generation-config
        default_sampling_params=sampling_defaults(loaded.source or config.model, config.generation_config),
        block_tensors=block_tensors,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        scheduler=scheduler,
        runner=runner,
        tiers=kv_connector.manager,
        lora_manager=lora_manager,
        cpu_threads=cpu_threads,
        mm_processor=mm_processor,
        encoder_cache=encoder_cache,
        kv_event_publisher=create_publisher(kv_events_config),
        input_processor=InputProcessor(config, tokenizer, model_config, max_model_len, mm_processor),
        async_scheduling=async_scheduling,
    )
    logger.info("engine ready in %s", stages.summary())
    return parts


def _check_speculative(config: EngineArgs, model_config: ModelConfig) -> None:
    """Speculative decoding needs a model whose rejected drafts leave nothing behind: K/V rows are
    rewritten by the next step, a recurrent layer's state would have moved on. Steps are scheduled
    in order (a verifying step's gain is known when it is booked)."""
    if model_config.is_recurrent:
        raise ValueError(
            f"speculative_config cannot be used with the recurrent {model_config.architecture}: its state "
            "would have taken in the rejected drafts, and it is not rolled back"
        )
    if config.async_scheduling:
        raise ValueError(
            "speculative_config with async_scheduling=True is not implemented: how many tokens a step "
            "verifying drafts gains is known only when it is read (leave async_scheduling unset)"
        )


def _refuse_for_recurrent(config: EngineArgs, architecture: str) -> None:
    """A recurrent model's blocks hold its state, not K/V rows: the features that move or adapt
    K/V rows are refused by name rather than run wrong."""
    refused = [
        name
        for name, on in (
            ("kv_offloading_size", bool(config.kv_offloading_size)),
            ("kv_tier", bool(config.kv_tier)),
            ("enable_lora", config.enable_lora),
        )
        if on
    ]
    if refused:
        raise ValueError(
            f"{', '.join(refused)} cannot be used with the recurrent {architecture}: its blocks hold the "
            "layers' recurrent state, which the KV tiers do not move and LoRA does not adapt"
        )


def _cpu_thread_policy(config: EngineArgs, device: torch.device, stages: Stages) -> AdaptiveCpuThreads | None:
    """Compile the CPU kernels, then open the adaptive thread policy's first window (None on CUDA,
    when fixed, or without /proc/stat to measure the neighbours by)."""
    if device.type != "cpu":
        return None
    adaptive = config.cpu_thread_policy == "adaptive"
    with stages.stage("CPU kernels", KERNELS_BUILD):  # announced: the first start on a machine compiles
        prepare_cpu_kernels(row_split_too=adaptive)
    if not adaptive:
        return None
    threads = AdaptiveCpuThreads()
    return threads if threads.available else None


def _checked_thread_policy(
    threads: AdaptiveCpuThreads | None, runner: ModelRunner, dtype: torch.dtype, stages: Stages
) -> AdaptiveCpuThreads | None:
    """The adaptive policy only where outputs do not depend on the thread count."""
    if threads is None:
        return None
    check = "checking that outputs do not depend on the thread count (once per machine and model)"
    with stages.stage("thread check", check):
        agree = thread_counts_agree(runner.model, threads.configured)
    if not agree:
        logger.warning(
            "this CPU's %s kernels give other bits on other thread counts: the thread count stays "
            "fixed (cpu_thread_policy='adaptive' would make outputs depend on the neighbours' load)",
            str(dtype).removeprefix("torch."),
        )
        return None
    threads.watch_layers(runner.decoder_layers())  # a long step beside a neighbour times its layers on two counts
    return threads


_MODE_NAMES = {None: "eager", "capture": "CUDA graphs", "static": "static buffers, not captured"}


def _graph_mode(config: EngineArgs, device: torch.device, loaded: LoadedModel) -> str | None:
    """Whether decode steps are captured as CUDA graphs (cuda_graphs.py), logged on CUDA."""
    mode, why = graph_mode(device, config.enforce_eager, config.compilation_config)
    if mode is not None:
        model = loaded.model
        unsupported = model.static_decode_unsupported() if isinstance(model, LlamaModel) else "not a decoder model"
        if unsupported is not None:
            mode, why = None, f"eager for {loaded.config.architecture}: {unsupported}"
    if device.type == "cuda" or mode is not None:
        logger.info("decode steps: %s (%s)", _MODE_NAMES[mode], why)
    return mode


def _num_blocks(
    config: EngineArgs,
    device: torch.device,
    loaded: LoadedModel,
    block_tensors: BlockTensors,
    graph_rows: int,
    graph_logits_rows: int,
) -> int:
    if config.gpu_memory_utilization is not None and device.type != "cuda":
        logger.info("gpu_memory_utilization=%s changes nothing on the CPU", config.gpu_memory_utilization)
    if config.num_blocks is not None:
        return config.num_blocks
    bs = config.block_size
    if device.type == "cuda" and config.gpu_memory_utilization is not None:
        budget = cuda_kv_budget(
            loaded.model,
            config.gpu_memory_utilization,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            bs,
            graph_rows,
            graph_logits_rows,
            STAGE_BYTES if (config.kv_offloading_size or config.kv_tier) else 0,
        )
    else:
        budget = config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES
    num_blocks = block_tensors.num_blocks_for(budget)
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory_bytes={budget} holds no block of {bs} tokens")
    return num_blocks


def _async_scheduling(config: EngineArgs, device: torch.device) -> bool:
    """Whether steps may be scheduled ahead (async_scheduling; unset: on a GPU). What a step
    writes besides K/V rows keeps the order of an engine that waits for every step: the KV tiers'
    transfers copy at launch, in stream order, and a block completed before its last token was
    known is keyed when its step is booked (tiers/scheduler_connector.py); the stage-output
    cache's rows, and the tiers' share of them, are written when a step is booked and read only
    once made readable there (stage_outputs/store.py); a recurrent layer's state is written in
    stream order, and the step a request that stopped computes ahead overwrites the state of its
    last block, which no cache entry names - blocks are entered only up to the tokens known - and
    which is freed with it; a block that leaves a sliding window when a step is scheduled ahead
    may go to another request in that step: the step in flight, which may still read it, runs
    first."""
    asked = config.async_scheduling
    return bool(asked or (asked is None and device.type == "cuda"))


def _group_kind(model_config: ModelConfig) -> str:
    """What group 0's blocks hold, in vLLM's kv_cache_spec_kind names: a model with no attention
    layer keeps only its state after each block ("mamba"); any other keeps every block's K/V rows
    as full attention does (a hybrid's state beside them)."""
    n = model_config.num_hidden_layers
    return "mamba" if not any(model_config.is_attention_layer(i) for i in range(n)) else "full_attention"


def _kv_groups(config: EngineArgs, model_config: ModelConfig) -> KVCacheGroups | None:
    """A KV-cache group per layer kind for a model mixing full and sliding-window attention
    (memory/kv_groups.py), unless turned off or a feature that moves whole blocks is on."""
    groups = plan_kv_groups(model_config)
    if groups is None or config.disable_hybrid_kv_cache_manager:
        return None
    keeps_whole_blocks = [
        name
        for name, on in (
            ("kv_tier / kv_offloading_size", bool(config.kv_tier or config.kv_offloading_size)),
            ("enable_stage_output_cache", config.enable_stage_output_cache),
        )
        if on
    ]
    if keeps_whole_blocks:
        logger.info(
            "%s moves whole blocks of every layer: %s keeps its sliding-window layers' blocks in full "
            "(no KV-cache groups)",
            " and ".join(keeps_whole_blocks),
            model_config.architecture,
        )
        return None
    logger.info(
        "KV-cache groups: %d of %d layers each, windows %s (blocks out of a window are freed while a request runs)",
        groups.group_size,
        model_config.num_hidden_layers,
        ", ".join("full" if w is None else str(w) for w in groups.windows),
    )
    return groups


def _max_model_len(
    config: EngineArgs, model_config: ModelConfig, num_blocks: int, kv_groups: KVCacheGroups | None = None
) -> int:
    bs = config.block_size
    capacity = num_blocks * bs
    if kv_groups is not None:  # a request holds a block table per group
        capacity = kv_groups.max_tokens(num_blocks, config.max_num_batched_tokens, bs)
    bound = model_config.exact_context_bound
    if bound is not None and (config.max_model_len or 0) > bound[0]:
        raise ValueError(
            f"max_model_len={config.max_model_len} is past this model's {bound[1]} ({bound[0]} tokens): "
            f"{bound[2]}; use max_model_len <= {bound[0]}"
        )
    if config.max_model_len is None:
        longest = model_config.max_position_embeddings
        if bound is not None and bound[0] < longest:
            logger.info("max_model_len %d: this model's %s (%s; max_position_embeddings says %d)", *bound, longest)
            longest = bound[0]
        return min(longest, capacity)
    if config.max_model_len > capacity:
        held = f"{num_blocks} blocks x {bs} = {capacity} tokens"
        if kv_groups is not None:
            held = f"{num_blocks} blocks, which hold {capacity} tokens in {len(kv_groups.windows)} KV-cache groups"
        raise ValueError(
            f"max_model_len={config.max_model_len} does not fit in the KV budget of {held}; raise "
            "kv_cache_memory_bytes / num_blocks or lower max_model_len"
        )
    return config.max_model_len


def _default_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    if seed is None:
        generator.seed()  # a random seed, as vLLM's seed=None
    else:
        generator.manual_seed(seed % 2**64)
    return generator


def _separate_tokenizer(path: str, model_vocab: int) -> Tokenizer:
    from ..model.loader import load_tokenizer

    tok = load_tokenizer(path)
    if tok.vocab_size > model_vocab:
        raise ValueError(
            f"tokenizer {path!r} has {tok.vocab_size} tokens; the model's vocabulary has {model_vocab}: "
            "its ids would index past the embedding table"
        )
    return tok
