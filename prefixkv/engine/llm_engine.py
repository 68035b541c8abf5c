"""The engine loop: admit requests, then per step schedule -> execute -> update -> emit outputs.

The scheduler owns the KV cache manager and the request bookkeeping; the model runner owns the
model and sampling; this class owns what the client sees: request groups (n sequences of one
prompt), detokenized outputs and stop conditions (output_processor.py), errors, KV events and
the stats snapshot.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..cache import (
    KVCacheEvent,
    KVCacheManager,
    KVEventBuffer,
    PrefixCacheStats,
    ResidencyMetrics,
    get_hash_function,
    none_hash,
)
from ..constraints.grammar import GrammarEngine
from ..constraints.token_constraints import RequestConstraints
from ..constraints.validation import check_vocab
from ..engine_args import DEFAULT_KV_CACHE_BYTES, DTYPES, EngineArgs
from ..kv_events import EventPublisher, KVEventsConfig, create_publisher
from ..lora.manager import LoRAManager
from ..lora.request import LoRARequest
from ..memory.block_tensors import BlockTensors, kv_cache_specs
from ..model import LoadedModel, load_model
from ..model.generation_config import sampling_defaults
from ..model.tokenizer import Tokenizer
from ..model.warmup import KERNELS_BUILD, prepare_cpu_kernels
from ..outputs import Logprob, RequestMetrics, RequestOutput
from ..progress import Stages
from ..request import MultiModalItem, Request, RequestStatus
from ..sampling_params import SamplingParams
from ..stage_outputs import StageOutputCache, stage_output_specs
from ..tiers import TierManager, build_kv_connector
from .cpu_threads import AdaptiveCpuThreads, thread_counts_agree
from .gpu_memory import cuda_kv_budget
from .model_runner import ModelRunner
from .model_runner_output import ModelRunnerOutput
from .output_processor import OutputState, logprob_entry, status_for
from .scheduler import Scheduler
from .scheduler_output import SchedulerOutput
from .stats import EngineStats

logger = logging.getLogger("prefixkv")

# nothing to run but slow-tier loads: wait this long for one, then step again (new requests,
# aborts and the server's commands are taken between steps)
TIER_LOAD_NAP_S = 0.01
MAX_PENDING_KV_EVENTS = 10_000  # engine-level buffer for the publisher: beyond it the oldest are dropped


def resolve_device_dtype(config: EngineArgs, loaded: LoadedModel | None = None) -> tuple[torch.device, torch.dtype]:
    """The engine's device and dtype: as configured; where left to the engine, those of a model
    handed in already loaded (its weights decide where the KV cache must live), else CUDA when
    present in bfloat16, the CPU in float32 (as vLLM). A configured one that contradicts the
    loaded model's is refused: the engine would put its KV cache where the model cannot read it."""
    if config.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {config.dtype!r}; choose {', '.join(DTYPES)}")
    weights = loaded.model.embed_tokens.weight if loaded is not None else None
    if config.device is not None:
        device = torch.device(config.device)
    elif weights is not None:
        device = weights.device
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and weights is None:
        if not torch.cuda.is_available():
            raise ValueError(f"device={config.device!r} but CUDA is not available here (torch {torch.__version__})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device={config.device!r} but this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    name = DTYPES[config.dtype]
    if weights is not None:
        if device.type != weights.device.type or (device.index is not None and device != weights.device):
            raise ValueError(f"device={config.device!r} but the model handed to the engine is on {weights.device}")
        if name is not None and getattr(torch, name) != weights.dtype:
            raise ValueError(f"dtype={config.dtype!r} but the model handed to the engine is {weights.dtype}")
        return device, weights.dtype
    return device, getattr(torch, name or ("float32" if device.type == "cpu" else "bfloat16"))


@dataclass
class _Group:
    """A user request: n sequences sampled from one prompt (they share its cached blocks)."""

    request_id: str  # the client's id (unique among live groups)
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    states: list[OutputState]
    arrival_time: float
    # [None, entry for prompt token 1, ...] while prompt logprobs are wanted (filled by child 0)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None
    hidden_states: list[torch.Tensor] | None = None  # prompt hidden states as they arrive, when asked


def _separate_tokenizer(path: str, model_vocab: int) -> Tokenizer:
    from ..model.loader import load_tokenizer

    tok = load_tokenizer(path)
    if tok.vocab_size > model_vocab:
        raise ValueError(
            f"tokenizer {path!r} has {tok.vocab_size} tokens; the model's vocabulary has {model_vocab}: "
            "its ids would index past the embedding table"
        )
    return tok


class LLMEngine:
    def truncate_prompt(self, ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens (-1: max_model_len), as vLLM."""
        k = params.truncate_prompt_tokens
        if k is None:
            return ids
        k = self.max_model_len if k == -1 else k
        return ids[-k:] if len(ids) > k else ids

    def __init__(self, config: EngineArgs, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.device, self.dtype = resolve_device_dtype(config, loaded)
        # each stage timed, announced when slow (progress.py), and one line when ready
        stages = Stages(logger)
        adaptive = self.device.type == "cpu" and config.cpu_thread_policy == "adaptive"
        if self.device.type == "cpu":
            # built here, before the thread policy's first window opens: the compiler's CPU time
            # would read as a neighbour's (and announced: the first start on a machine compiles)
            with stages.stage("CPU kernels", KERNELS_BUILD):
                prepare_cpu_kernels(row_split_too=adaptive)
        # thread count per step under CPU contention (cpu_threads.py); None on CUDA or when fixed.
        # Made before the model loads: its first window of foreign load spans the loading, so the
        # first step already knows its neighbours.
        self.cpu_threads: AdaptiveCpuThreads | None = None
        if adaptive:
            self.cpu_threads = AdaptiveCpuThreads()
            if not self.cpu_threads.available:  # no /proc/stat: nothing to measure the neighbours by
                self.cpu_threads = None
        if loaded is None:
            with stages.stage("model", f"loading {config.model or 'the embedded SmolLM2-135M-Instruct'}"):
                loaded = load_model(config.model, dtype=self.dtype, device=self.device)
        self.loaded = loaded
        self.tokenizer = self.loaded.tokenizer
        if config.tokenizer is not None and config.tokenizer != config.model:
            self.tokenizer = _separate_tokenizer(config.tokenizer, self.loaded.config.vocab_size)
        # the model creator's sampling defaults (generation_config.json), as vLLM's --generation-config
        self.default_sampling_params = sampling_defaults(self.loaded.source or config.model, config.generation_config)
        self.model_config = self.loaded.config
        bs = config.block_size
        # Every per-block tensor is registered before the budget is divided among them.
        self.block_tensors = BlockTensors(kv_cache_specs(self.model_config, bs, self.dtype))
        if config.enable_stage_output_cache:  # the hidden states of cached blocks, in the same budget
            for spec in stage_output_specs(self.model_config, bs, self.dtype):
                self.block_tensors.register(spec)
        if config.gpu_memory_utilization is not None and self.device.type != "cuda":
            logger.info("gpu_memory_utilization=%s changes nothing on the CPU", config.gpu_memory_utilization)
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
        else:
            if self.device.type == "cuda" and config.gpu_memory_utilization is not None:
                budget = cuda_kv_budget(
                    self.loaded.model,
                    config.gpu_memory_utilization,
                    config.max_num_batched_tokens,
                    config.max_num_seqs,
                    bs,
                )
            else:
                budget = config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES
            num_blocks = self.block_tensors.num_blocks_for(budget)
            if num_blocks < 1:
                raise ValueError(f"kv_cache_memory_bytes={budget} holds no block of {bs} tokens")
        capacity = num_blocks * bs
        if config.max_model_len is not None:
            if config.max_model_len > capacity:
                raise ValueError(
                    f"max_model_len={config.max_model_len} does not fit in the KV budget "
                    f"of {num_blocks} blocks x {bs} = {capacity} tokens; raise "
                    "kv_cache_memory_bytes / num_blocks or lower max_model_len"
                )
            self.max_model_len = config.max_model_len
        else:
            self.max_model_len = min(self.model_config.max_position_embeddings, capacity)
        self.num_blocks = num_blocks
        with stages.stage("KV cache", f"allocating the KV cache ({num_blocks} blocks)"):
            self.block_tensors.allocate(num_blocks, self.device)
        # one hash function for the scheduler's cache and the tiers' namespace (an xxhash one is seeded per process)
        hash_fn = get_hash_function(config.prefix_caching_hash_algo)
        kv_connector = build_kv_connector(
            config,
            self.block_tensors,
            self.loaded,
            self.tokenizer,
            dtype=self.dtype,
            device=self.device,
            root_hash=none_hash(hash_fn),
        )
        self.tiers: TierManager | None = kv_connector.manager  # KV tiers below the pool (prefixkv/tiers)
        self.scheduler = Scheduler(
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
        )
        self.lora_manager: LoRAManager | None = None
        if config.enable_lora:
            self.lora_manager = LoRAManager(
                self.model_config,
                max_loras=config.max_loras,
                max_lora_rank=config.max_lora_rank,
                dtype=self.dtype,
                device=self.device,
            )
        default_generator = torch.Generator()
        if config.seed is None:
            default_generator.seed()  # a random seed, as vLLM's seed=None
        else:
            default_generator.manual_seed(config.seed % 2**64)
        on_cpu = self.device.type == "cpu"
        layout = "laying the weights out for the CPU's kernels" if on_cpu else "building the model runner"
        with stages.stage("weight layout" if on_cpu else "runner", layout):
            self.runner = ModelRunner(
                self.loaded,
                self.block_tensors,
                self.dtype,
                self.device,
                default_generator,
                self.lora_manager,
                kv_connector=kv_connector.worker,
            )
        agree = True
        if self.cpu_threads is not None:
            check = "checking that outputs do not depend on the thread count (once per machine and model)"
            with stages.stage("thread check", check):
                agree = thread_counts_agree(self.runner.model, self.cpu_threads.configured)
        if self.cpu_threads is not None and not agree:
            logger.warning(
                "this CPU's %s kernels give other bits on other thread counts: the thread count stays "
                "fixed (cpu_thread_policy='adaptive' would make outputs depend on the neighbours' load)",
                str(self.dtype).removeprefix("torch."),
            )
            self.cpu_threads = None
        if self.cpu_threads is not None:  # a long step beside a neighbour times its layers on two counts
            self.cpu_threads.watch_layers(self.runner.decoder_layers())
        self.stage_outputs: StageOutputCache | None = None
        if config.enable_stage_output_cache:
            blocks = self.scheduler.kv_cache_manager.block_pool.blocks
            self.stage_outputs = StageOutputCache(self.block_tensors, blocks, bs)
            self.scheduler.stage_outputs = self.runner.stage_outputs = self.stage_outputs
        self._init_multimodal()
        self.eos_ids = set(self.tokenizer.eos_token_ids)
        self._grammar_engine: GrammarEngine | None = None  # built on the first structured request
        self._grammar_lock = threading.Lock()
        self._groups: dict[str, _Group] = {}
        self._child_of: dict[str, tuple[_Group, int]] = {}  # engine-private sequence id -> (group, index)
        self._group_ids = itertools.count()  # ids for requests that bring none
        self._seq_ids = itertools.count()  # engine-private sequence ids: never derived from a client's string
        self._kv_events = KVEventBuffer(MAX_PENDING_KV_EVENTS)
        # events leave the process through a publisher when kv_events_config says so (kv_events/);
        # otherwise they wait in _kv_events for take_kv_events()
        kv_events_config = config.kv_events_config
        assert kv_events_config is None or isinstance(kv_events_config, KVEventsConfig)  # EngineArgs parsed it
        self.kv_event_publisher: EventPublisher | None = create_publisher(kv_events_config)
        # counters for metrics
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_requests_errored = 0
        self.num_steps = 0
        self.last_step_num_tokens = 0  # tokens computed by the last step (vllm:iteration_tokens_total)
        self._stats = EngineStats()
        self._update_stats()
        logger.info("engine ready in %s", stages.summary())

    def _init_multimodal(self) -> None:
        """A vision-language checkpoint: the prompt-side processor (placeholders, item identities) and
        the runner-side encoder with its cache (prefixkv/multimodal/)."""
        self.mm_processor: Any = None
        self.encoder_cache: Any = None
        self.image_token: str | None = None  # the prompt's image token as text ("<image>"); None: text-only
        self.max_images: int | None = None  # limit_mm_per_prompt["image"]
        mm = self.loaded.multimodal
        if mm is None:
            return
        self.image_token = self.tokenizer.id_to_token(mm.image_token_id)
        from ..multimodal import EncoderCache, MultiModalEmbedder, MultiModalInputProcessor

        config = self.config
        self.max_images = limit = (config.limit_mm_per_prompt or {}).get("image")
        self.mm_processor = MultiModalInputProcessor(mm, config.mm_hash, limit)
        self.encoder_cache = EncoderCache(config.mm_encoder_cache_bytes if config.enable_mm_encoder_cache else 0)
        self.runner.mm = MultiModalEmbedder(mm.encoder, self.encoder_cache)

    def process_multimodal(
        self, prompt_token_ids: Sequence[int], multi_modal_data: Any
    ) -> tuple[list[int], tuple[MultiModalItem, ...]]:
        """Expand a prompt's image tokens and build its items (no engine state is touched, so any
        thread may call it). ValueError for images on a text-only model, a count of image tokens
        that differs from the count of images, too many images, or an image that cannot be decoded."""
        if self.mm_processor is None:
            if multi_modal_data:
                raise ValueError(
                    "multi_modal_data was given but this model is text-only: it takes no images "
                    "(serve a LLaVA-style checkpoint for image inputs)"
                )
            return list(prompt_token_ids), ()
        ids, items = self.mm_processor(prompt_token_ids, multi_modal_data)
        return ids, items

    # -- admission -----------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= vocab]
        if bad:
            raise ValueError(f"prompt token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context "
                f"(max_model_len) is {self.max_model_len} tokens, which must also hold "
                "at least one generated token"
            )

    def validate_params(self, params: SamplingParams) -> None:
        """What depends on this engine, beyond SamplingParams' own checks (run again here: the
        dataclass is mutable)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")  # noqa: TRY004
        params.verify()
        limit = min(self.config.max_logprobs, self.model_config.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise ValueError(f"{name}={value} is more than this engine allows (max_logprobs={limit})")
        check_vocab(params, self.model_config.vocab_size)
        if params.structured_outputs is not None and params.min_tokens:
            raise ValueError(
                "min_tokens cannot be combined with structured_outputs: the grammar decides where the output ends"
            )

    @property
    def grammar_engine(self) -> GrammarEngine:
        """The structured-outputs grammar engine (built once, on first use: ~0.1 s)."""
        with self._grammar_lock:
            if self._grammar_engine is None:
                self._grammar_engine = GrammarEngine(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_ids))
            return self._grammar_engine

    def compile_grammar(self, params: SamplingParams) -> Any:
        """The compiled grammar of `params.structured_outputs` (None without one), cached by spec.
        Thread-safe: the server calls it in a worker thread before the request reaches the engine
        loop, so a step never waits for a compilation. ValueError for an invalid spec."""
        if params.structured_outputs is None:
            return None
        params.structured_outputs.verify()
        return self.grammar_engine.compile(params.structured_outputs)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        prompt_text: str | None = None,
        hidden_states_from: int | None = None,
        priority: int = 0,
        multi_modal_data: Any = None,
        mm_items: Sequence[MultiModalItem] | None = None,
    ) -> str:
        """Queue one prompt (text or token ids; `prompt_text` names the text that token ids came
        from). Returns the request id. Images come as `multi_modal_data` ({"image": ...}, one
        image token per image in the prompt), or already processed (`process_multimodal`) as
        expanded token ids with their `mm_items`. Atomic: everything that can fail - validation,
        tokenization, seeded generators - happens before any state changes, so on an exception
        nothing is registered."""
        params = params if params is not None else SamplingParams()
        self.validate_params(params)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(
                f"Got priority {priority} but priority scheduling is not enabled "
                "(scheduling_policy='priority' / --scheduling-policy priority)"
            )
        compiled = self.compile_grammar(params)
        lora_id = 0
        if lora_request is not None:
            lora_request, lora_id = self.resolve_lora(lora_request)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        text: str | None
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenize(prompt)
        else:
            text, ids = prompt_text, list(prompt)
        if mm_items is None:  # (given mm_items: the caller processed - and truncated - the prompt)
            ids = self.truncate_prompt(ids, params)
            ids, mm_items = self.process_multimodal(ids, multi_modal_data)
        elif multi_modal_data is not None:
            raise ValueError("give multi_modal_data or processed mm_items, not both")
        elif mm_items and self.mm_processor is None:
            raise ValueError("multimodal items were given but this model is text-only: it takes no images")
        self.validate_prompt(ids)
        if params.return_hidden_states and hidden_states_from is None:
            hidden_states_from = 0  # every position, the prompt's first on
        if hidden_states_from is not None:  # the prompt's final hidden states from this position on
            if not isinstance(hidden_states_from, int) or not -len(ids) <= hidden_states_from < len(ids):
                raise ValueError(f"hidden_states_from={hidden_states_from!r} is not a position of the prompt")
            hidden_states_from %= len(ids)
        if request_id is None:
            request_id = str(next(self._group_ids))
            while request_id in self._groups:  # a client may have taken it
                request_id = str(next(self._group_ids))
        elif not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        elif request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if arrival_time is None:
            arrival = time.time()
        elif isinstance(arrival_time, (int, float)) and math.isfinite(arrival_time):
            arrival = float(arrival_time)
        else:
            raise ValueError(f"arrival_time must be a finite number, got {arrival_time!r}")
        children, states = [], []
        constraints = RequestConstraints.build(params, self.tokenizer, self.model_config.vocab_size)
        for i in range(params.n):
            # seed + i wraps modulo 2**64 (what torch takes): any valid seed works for any n
            gen = torch.Generator().manual_seed((params.seed + i) % 2**64) if params.seed is not None else None
            children.append(
                Request(
                    f"seq-{next(self._seq_ids)}",
                    ids,
                    sampling_params=params,
                    lora_request=lora_request,
                    cache_salt=cache_salt,
                    prompt=text,
                    arrival_time=arrival,
                    generator=gen,
                    priority=priority,
                    mm_items=mm_items,
                )
            )
            children[-1].lora_id = lora_id
            if compiled is not None:  # each sequence walks its own grammar
                grammar = self.grammar_engine.matcher(compiled)
                children[-1].constraints = (
                    constraints.shares_with(grammar)
                    if constraints is not None
                    else RequestConstraints(self.model_config.vocab_size, grammar=grammar)
                )
            else:
                children[-1].constraints = constraints
            states.append(OutputState(i, params, self.tokenizer))
        group = _Group(request_id, text, ids, children, states, arrival)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
            if self.stage_outputs is not None:  # cache hits give their hidden states back
                children[0].reads_stage_outputs = True
            else:
                children[0].skip_prefix_cache_read = True
        if hidden_states_from is not None:
            group.hidden_states = []
            children[0].prompt_hidden_upto = hidden_states_from
            if hidden_states_from < len(ids) - 1:  # the last position is always computed, others may be hits
                if self.stage_outputs is not None:
                    children[0].reads_stage_outputs = True
                else:
                    children[0].skip_prefix_cache_read = True
        # -- commit: nothing below can fail --
        self._groups[request_id] = group
        for i, child in enumerate(children):
            self._child_of[child.request_id] = (group, i)
            self.scheduler.add_request(child)
        self.num_prompt_tokens += len(ids) * params.n
        self._update_stats()
        return request_id

    def resolve_lora(self, lora_request: LoRARequest, reload: bool = False) -> tuple[LoRARequest, int]:
        """Load (once) and validate the adapter of `lora_request`; returns the request with its
        weights digest filled in (the cache identity) and the engine's adapter id. A loaded
        adapter's folder is not looked at again unless `reload`: then its files are read again and
        new content (by sha256) replaces the old version. ValueError when LoRA is off or the
        adapter cannot be served."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")  # noqa: TRY004
        if self.lora_manager is None:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} requested but LoRA is off: start the engine with "
                "enable_lora=True (--enable-lora)"
            )
        resolved = self.lora_manager.resolve(lora_request, reload)
        if self.lora_manager.retired:  # a reload with new weights retired the old version
            self._evict_retired_loras()
        return resolved

    def remove_lora(self, name: str) -> bool:
        """Forget every adapter version named `name` (vLLM's `remove_lora`, by name). Requests
        already running finish with it; its cached blocks can never be hit again and are evicted
        first (those still held, once their requests end). Returns whether it was known."""
        if self.lora_manager is None:
            return False
        known = self.lora_manager.remove(name)
        self._evict_retired_loras()
        return known

    def _evict_retired_loras(self) -> None:
        """Evict the blocks cached under retired adapter versions; keep the list while running
        requests still hold some, and drop the host copies of versions nobody uses."""
        manager = self.lora_manager
        assert manager is not None
        retired = manager.retired
        _, held = self.kv_cache_manager.evict_where(lambda extras: any(k in retired for k in extras))
        if not held:
            retired.clear()
        in_use = {c.lora_id for g in self._groups.values() for c in g.children if not c.is_finished}
        manager.forget_unused(in_use)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests wherever they are; their blocks are freed at once. Unknown ids are ignored."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self._groups.get(rid)
            if group is not None:
                self._end_group(group, RequestStatus.FINISHED_ABORTED)
        if self.lora_manager is not None and self.lora_manager.retired:
            self._evict_retired_loras()
        if self.cpu_threads is not None and not self.has_unfinished_requests():
            self.cpu_threads.restore()  # idle after an abort too (a disconnect, an interrupted generate)
        self._update_stats()

    def _end_group(self, group: _Group, status: RequestStatus) -> None:
        """Finish every unfinished sequence of a group with `status` and forget the group."""
        for child, state in zip(group.children, group.states):
            if not child.is_finished:
                state.abort()
                self.scheduler.finish_request(child, status)
        self._forget(group)

    def _forget(self, group: _Group) -> None:
        self._groups.pop(group.request_id, None)
        for child in group.children:
            self._child_of.pop(child.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step: schedule -> execute -> update -> emit. Returns an output for every
        request that produced a token (cumulative text and tokens), finished or failed in this
        step. Per-request failures finish that request with `RequestOutput.error`; a failing
        forward pass fails the batch's requests the same way. Neither raises."""
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output:
            if self.scheduler.num_loading:  # requests wait for slow-tier loads (tiers/): nap until one is done
                self.scheduler.wait_for_tier_loads(TIER_LOAD_NAP_S)
                outputs = []
            else:
                stuck = self.scheduler.waiting and not scheduler_output.preempted_req_ids
                outputs = self._fail_unschedulable() if stuck else []
        else:
            self.num_steps += 1
            self.last_step_num_tokens = scheduler_output.num_scheduled_tokens
            if self.cpu_threads is not None:
                self.cpu_threads.before_step(scheduler_output.num_scheduled_tokens)
            try:
                runner_output = self.runner.execute(scheduler_output)
            except Exception as e:  # noqa: BLE001 (any failure of the forward fails the batch, not the engine)
                outputs = self._fail_step(scheduler_output, e)
            else:
                sampled, failed = self.scheduler.update_from_output(scheduler_output, runner_output)
                outputs = self._process_outputs(runner_output, sampled, failed)
        if self.lora_manager is not None and self.lora_manager.retired and any(o.finished for o in outputs):
            self._evict_retired_loras()  # held blocks of retired adapters may be free now
        if self.cpu_threads is not None and not self.has_unfinished_requests():
            self.cpu_threads.restore()  # idle: the caller's torch code gets its own thread count back
        self._drain_kv_events()
        self._update_stats()
        return outputs

    def _process_outputs(
        self, runner_output: ModelRunnerOutput, sampled: list[Request], failed: list[Request]
    ) -> list[RequestOutput]:
        """The output processor's half of the step: prompt logprobs, detokenized text, stop
        conditions (a stopped sequence is finished in the scheduler), failed groups."""
        for req_id, scored in runner_output.prompt_logprobs.items():
            group = self._child_of[req_id][0]
            entries = group.prompt_logprobs
            if entries is None:  # only groups that asked are scored
                continue
            prompt = group.prompt_token_ids
            for pos, p_lp, p_rank, p_top in zip(
                itertools.count(scored.first), scored.logprobs, scored.ranks, scored.top
            ):
                entries.append(logprob_entry(self.tokenizer, prompt[pos], p_lp, p_rank, p_top))
        for req_id, (_, rows) in runner_output.hidden_states.items():
            hidden = self._child_of[req_id][0].hidden_states
            if hidden is not None:
                hidden.append(rows)
        touched: dict[str, _Group] = {}
        now = time.time()
        lps, tops, ranks = runner_output.logprobs, runner_output.top_logprobs, runner_output.ranks
        for row, req in enumerate(sampled):
            self.num_generation_tokens += 1
            group, idx = self._child_of[req.request_id]
            touched[group.request_id] = group
            token = runner_output.sampled_token_ids[row]
            lp: float | None = None
            top: list[tuple[int, float]] | None = None
            rank: int | None = None
            if lps is not None and tops is not None and ranks is not None and req.sampling_params.logprobs is not None:
                lp, top, rank = lps[row], tops[row], ranks[row]
            try:
                done = group.states[idx].update(req, token, self.eos_ids, self.max_model_len, lp, top, rank)
            except Exception as e:  # noqa: BLE001 (e.g. detokenizing: this request fails alone)
                req.error = f"processing the output failed: {type(e).__name__}: {e}"
                failed.append(req)
                continue
            if done:
                req.finished_time = now
                self.scheduler.finish_request(req, status_for(group.states[idx].finish_reason or "stop"))
        for req in failed:
            entry = self._child_of.get(req.request_id)
            if entry is not None:
                self._fail_group(entry[0], req.error or "the request failed")
                touched[entry[0].request_id] = entry[0]
        outputs = []
        for group in touched.values():
            out = self._output(group)
            outputs.append(out)
            if out.finished:
                self._forget(group)
        return outputs

    def _fail_group(self, group: _Group, message: str) -> None:
        if group.error is None:
            group.error = message
            self.num_requests_errored += 1
            logger.warning("request %s failed: %s", group.request_id, message)
        for child, state in zip(group.children, group.states):
            if child.request_id in self.scheduler.requests:
                self.scheduler.finish_request(child, RequestStatus.FINISHED_ERROR)
            if child.status is RequestStatus.FINISHED_ERROR or state.finish_reason is None:
                state.abort()

    def _fail_step(self, scheduler_output: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """The forward pass failed: the batch's new blocks were entered in the cache table but
        hold no valid KV. Fail the batch's requests and forget every cached identity so no later
        request hits them; if other requests hold blocks the table cannot be reset under them,
        so they fail too. The engine keeps serving."""
        logger.exception("the model failed in a step of %d requests", len(scheduler_output.scheduled))
        message = f"the model failed: {type(exc).__name__}: {exc}"
        groups = self._groups_of([sr.req_id for sr in scheduler_output.scheduled])
        for group in groups:
            self._fail_group(group, message)
        if not self.scheduler.reset_prefix_cache():
            others = self._groups_of([r.request_id for r in self.scheduler.running])
            for group in others:
                self._fail_group(group, message)
            groups += others
            self.scheduler.reset_prefix_cache()
        outputs = [self._output(g) for g in groups]
        for group in groups:
            self._forget(group)
        return outputs

    def _fail_unschedulable(self) -> list[RequestOutput]:
        """Nothing could be scheduled although requests wait (a request that can never fit):
        fail the head of the queue rather than spin."""
        head = self.scheduler.waiting[0]
        group = self._child_of[head.request_id][0]
        self._fail_group(group, "the request cannot be scheduled: it does not fit in the KV cache")
        out = self._output(group)
        self._forget(group)
        return [out]

    def _groups_of(self, req_ids: list[str]) -> list[_Group]:
        seen: dict[str, _Group] = {}
        for rid in req_ids:
            entry = self._child_of.get(rid)
            if entry is not None:
                seen.setdefault(entry[0].request_id, entry[0])
        return list(seen.values())

    def _output(self, group: _Group) -> RequestOutput:
        first = group.children[0]
        finished = group.error is not None or all(c.is_finished for c in group.children)
        first_token = min((c.first_token_time for c in group.children if c.first_token_time), default=None)
        metrics = RequestMetrics(
            arrival_time=group.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=first_token,
            last_token_time=time.time(),
            finished_time=max((c.finished_time or 0.0) for c in group.children) if finished else None,
        )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=[s.completion(c) for s, c in zip(group.states, group.children)],
            finished=finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            metrics=metrics,
            prompt_logprobs=group.prompt_logprobs,
            error=group.error,
            hidden_states=torch.cat(group.hidden_states) if finished and group.hidden_states else None,
        )

    # -- KV events -----------------------------------------------------------------------------
    def _drain_kv_events(self) -> None:
        events = self.scheduler.take_kv_events()
        if events:
            if self.kv_event_publisher is not None:  # one batch per step, as vLLM; never blocks
                self.kv_event_publisher.publish(events)
                return
            buffer = self._kv_events
            for event in events:
                buffer.append(event)

    def take_kv_events(self) -> list[KVCacheEvent]:
        """Every KV event not taken yet, oldest first ([] when a kv_events_config publisher sends them). At most
        MAX_PENDING_KV_EVENTS wait between calls; older ones are dropped and counted in
        `get_stats().num_kv_events_dropped`."""
        self._drain_kv_events()
        return self._kv_events.drain()

    def shutdown(self) -> None:
        """Release what outlives a step: the KV event publisher's thread and sockets (queued batches
        are sent first, for at most a second). The engine serves no request afterwards."""
        publisher, self.kv_event_publisher = self.kv_event_publisher, None
        if publisher is not None:
            publisher.shutdown()

    # -- cache control and statistics ----------------------------------------------------------
    def reset_prefix_cache(self, keep_pinned: bool = False) -> bool:
        ok = self.scheduler.reset_prefix_cache(keep_pinned)
        self._drain_kv_events()
        self._update_stats()
        return ok

    # -- pinned prefixes (prefixkv/cache/pins.py) ------------------------------------------------
    def _prefix_request(
        self, prompt_token_ids: list[int], cache_salt: str | None, lora_request: LoRARequest | None
    ) -> Request:
        """A request naming the prefix's blocks exactly as an admitted one would (its adapter
        resolved to the identity its blocks carry)."""
        if not prompt_token_ids:
            raise ValueError("a prefix to pin has at least one token")
        lora = self.resolve_lora(lora_request)[0] if lora_request is not None else None
        return Request(f"pin-{next(self._seq_ids)}", prompt_token_ids, lora_request=lora, cache_salt=cache_salt)

    def pin_prefix(
        self, prompt_token_ids: list[int], cache_salt: str | None = None, lora_request: LoRARequest | None = None
    ) -> int:
        """Pin the cached whole blocks of this prefix (compute it first: `LLM.pin_prefix` does);
        returns the tokens pinned. PinError (a ValueError) when nothing of it is cached or the pin
        would pass max_pinned_fraction."""
        pin = self.scheduler.kv_cache_manager.pin(self._prefix_request(prompt_token_ids, cache_salt, lora_request))
        self._update_stats()
        return pin.num_tokens

    def unpin_prefix(
        self, prompt_token_ids: list[int], cache_salt: str | None = None, lora_request: LoRARequest | None = None
    ) -> int:
        """Release the pin of this prefix (same tenant, same adapter); returns the tokens it held,
        0 when it was not pinned."""
        request = self._prefix_request(prompt_token_ids, cache_salt, lora_request)
        pin = self.scheduler.kv_cache_manager.unpin(request)
        self._update_stats()
        return 0 if pin is None else pin.num_tokens

    def get_stats(self) -> EngineStats:
        """The latest snapshot; safe to call from any thread. The KV tiers' counters are read
        now, not at the last step: their background writers finish saves between and after
        steps (after `tiers.flush()` the counters show every queued save, on an idle engine too)."""
        stats = self._stats
        if self.tiers is not None:
            return replace(stats, kv_tiers=self.tiers.stats())  # each tier's counters under its lock
        return stats

    def _update_stats(self) -> None:
        s = self.scheduler
        cache = s.prefix_cache_stats
        residency = s.kv_cache_manager.residency
        self._stats = EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            kv_cache_usage=s.kv_cache_usage,
            prefix_cache_requests=cache.requests,
            prefix_cache_queries=cache.queries,
            prefix_cache_hits=cache.hits,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_preemptions=s.num_preemptions,
            num_requests_errored=self.num_requests_errored,
            num_kv_events_dropped=self._kv_events.num_dropped
            + s.num_dropped_kv_events
            + (self.kv_event_publisher.num_dropped_events if self.kv_event_publisher is not None else 0),
            num_blocks=self.num_blocks,
            block_size=self.config.block_size,
            num_pinned_prefixes=len(s.kv_cache_manager.pins),
            num_pinned_blocks=s.kv_cache_manager.pins.num_pinned_blocks,
            kv_block_evictions=tuple(residency.evictions.items()) if residency is not None else (),
            max_model_len=self.max_model_len,
            **self._cpu_thread_stats(),
            **self._lora_stats(),
            **self._tier_stats(),
            **self._mm_stats(),
        )

    def _cpu_thread_stats(self) -> dict[str, Any]:
        t = self.cpu_threads
        if t is None:
            return {}
        return dict(
            cpu_threads=t.threads,
            cpu_foreign_load=t.load.cores,
            cpu_steps_adapted=t.steps_adapted,
            cpu_steps_probed=t.steps_probed,
            cpu_steps_row_split=t.steps_row_split,
        )

    def _tier_stats(self) -> dict[str, Any]:
        t = self.tiers
        if t is None:
            return {}
        return dict(
            external_prefix_cache_queries=t.external_queries,
            external_prefix_cache_hits=t.external_hits,
        )

    def _mm_stats(self) -> dict[str, Any]:
        if self.encoder_cache is None:
            return {}
        c = self.encoder_cache
        return dict(
            multimodal=True,
            mm_encoder_cache_queries=c.queries,
            mm_encoder_cache_hits=c.hits,
            mm_encoder_runs=c.encoder_runs,
            mm_encoder_cache_bytes=c.bytes_used,
            mm_encoder_cache_budget_bytes=c.budget_bytes,
        )

    def _lora_stats(self) -> dict[str, Any]:
        if self.lora_manager is None:
            return {}
        s = self.scheduler

        def names(reqs: Iterable[Request]) -> tuple[str, ...]:
            return tuple(sorted({r.lora_request.lora_name for r in reqs if r.lora_request is not None}))

        return dict(
            running_lora_adapters=names(s.running),
            waiting_lora_adapters=names(s.waiting),
            max_loras=self.lora_manager.max_loras,
        )

    # Read-through accessors kept for callers written before the scheduler owned the cache.
    @property
    def kv_cache_manager(self) -> KVCacheManager:
        return self.scheduler.kv_cache_manager

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.scheduler.prefix_cache_stats

    @property
    def kv_cache_usage(self) -> float:
        return self.scheduler.kv_cache_usage
