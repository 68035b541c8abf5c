"""The engine loop: admit requests, schedule a step, run the model, sample, emit outputs."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from ..cache import KVCacheManager
from ..config import DEFAULT_KV_CACHE_BYTES, EngineConfig
from ..model import LoadedModel, kv_cache_bytes_per_block, load_model
from ..outputs import RequestMetrics, RequestOutput
from ..request import LoRARequest, Request, RequestStatus
from ..sampling_params import SamplingParams
from .model_runner import ModelRunner
from .output_processor import OutputState, logprob_entry, status_for
from .sampler import sample, score_tokens
from .scheduler import Scheduler

def resolve_device_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    names = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "half": torch.float16}
    if config.dtype == "auto":
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    elif config.dtype in names:
        dtype = names[config.dtype]
    else:
        raise ValueError(f"unknown dtype {config.dtype!r}; choose auto, {', '.join(names)}")
    return device, dtype


@dataclass
class _Group:
    """A user request: n sequences sampled from one prompt (they share its cached blocks)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    states: list[OutputState]
    arrival_time: float
    finished: bool = False
    # [None, entry for prompt token 1, ...] while prompt logprobs are wanted (filled by child 0)
    prompt_logprobs: list | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.device, self.dtype = resolve_device_dtype(config)
        self.loaded = loaded or load_model(config.model, dtype=self.dtype, device=self.device)
        self.tokenizer = self.loaded.tokenizer
        self.model_config = self.loaded.config
        bs = config.block_size
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
        else:
            budget = config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES
            num_blocks = budget // kv_cache_bytes_per_block(self.model_config, bs, self.dtype)
            if num_blocks < 1:
                raise ValueError(f"kv_cache_memory_bytes={budget} holds no block of {bs} tokens")
        capacity = num_blocks * bs
        model_max = self.model_config.max_position_embeddings
        if config.max_model_len is not None:
            if config.max_model_len > capacity:
                raise ValueError(f"max_model_len={config.max_model_len} does not fit in the KV budget "
                                 f"of {num_blocks} blocks x {bs} = {capacity} tokens; raise "
                                 "kv_cache_memory_bytes / num_blocks or lower max_model_len")
            self.max_model_len = config.max_model_len
        else:
            self.max_model_len = min(model_max, capacity)
        self.num_blocks = num_blocks
        self.kv_cache_manager = KVCacheManager(
            num_blocks=num_blocks, block_size=bs, enable_caching=config.enable_prefix_caching,
            hash_algo=config.prefix_caching_hash_algo, hash_seed=None,
            enable_kv_cache_events=config.enable_kv_cache_events)
        self.scheduler = Scheduler(self.kv_cache_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.loaded, num_blocks, bs, self.dtype, self.device)
        self.eos_ids = set(self.tokenizer.eos_token_ids)
        self._groups: dict[str, _Group] = {}
        self._child_of: dict[str, tuple[_Group, int]] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._default_generator = torch.Generator().manual_seed(config.seed)
        self._ids = itertools.count()
        # counters for metrics
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_steps = 0

    # -- admission -----------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or t < 0 or t >= vocab]
        if bad:
            raise ValueError(f"prompt token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; this model's context "
                             f"(max_model_len) is {self.max_model_len} tokens, which must also hold "
                             "at least one generated token")

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, lora_request: LoRARequest | None = None,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    prompt_text: str | None = None) -> str:
        """Queue one prompt (text or token ids; `prompt_text` names the text that token ids came
        from). Raises ValueError, changing nothing, on bad input."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenize(prompt)
        else:
            text, ids = prompt_text, list(prompt)
        self.validate_prompt(ids)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.time() if arrival_time is None else arrival_time
        children, states = [], []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            child = Request(child_id, ids, sampling_params=params, lora_request=lora_request,
                            cache_salt=cache_salt, prompt=text, arrival_time=arrival)
            children.append(child)
            states.append(OutputState(i, params, self.tokenizer))
        group = _Group(request_id, text, ids, children, states, arrival)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
            children[0].skip_prefix_cache_read = True
        self._groups[request_id] = group
        for i, child in enumerate(children):
            self._child_of[child.request_id] = (group, i)
            if params.seed is not None:
                self._generators[child.request_id] = torch.Generator().manual_seed(params.seed + i)
            self.scheduler.add_request(child)
        self.num_prompt_tokens += len(ids) * params.n
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests wherever they are; their blocks are freed at once."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self._groups.pop(rid, None)
            if group is None:
                continue
            for child, state in zip(group.children, group.states):
                if not child.is_finished:
                    state.abort()
                    self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
                self._forget(child)

    def _forget(self, child: Request) -> None:
        self._child_of.pop(child.request_id, None)
        self._generators.pop(child.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step. Returns an output for every request that produced a token
        (cumulative text and tokens) or finished in this step."""
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.num_unfinished:
                raise RuntimeError("no request could be scheduled although some are waiting")
            return []
        self.num_steps += 1
        chunks, starts, tables, sample_rows, hidden_rows = [], [], [], [], []
        kv = self.kv_cache_manager
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start = req.num_computed_tokens
            chunks.append(req.all_token_ids[start:start + n])
            starts.append(start)
            tables.append(kv.get_block_ids(req.request_id))
            sample_rows.append(start + n == req.num_tokens)
            hidden_rows.append(self._wants_prompt_logprobs(req, start))
        try:
            logits, hidden = self.runner.execute(chunks, starts, tables, sample_rows,
                                                 hidden_rows if any(hidden_rows) else None)
            for req, start, h in zip(batch.requests, starts, hidden):
                if h is not None:
                    self._score_prompt(req, start, h)
        except Exception:
            self._fail_batch(batch.requests)
            raise
        sampled: list[Request] = []
        for req, n, s in zip(batch.requests, batch.num_new_tokens, sample_rows):
            req.num_computed_tokens += n
            if s:
                sampled.append(req)
        if not sampled:
            return []
        params = [r.sampling_params for r in sampled]
        gens = [self._generators.get(r.request_id, self._default_generator) for r in sampled]
        eos_block = [self.eos_ids if r.num_output_tokens < r.sampling_params.min_tokens else None
                     for r in sampled]
        result = sample(logits, params, gens, [r.prompt_token_ids for r in sampled],
                        [r.output_token_ids for r in sampled],
                        eos_block if any(e is not None for e in eos_block) else None)
        now = time.time()
        touched: dict[str, _Group] = {}
        for row, req in enumerate(sampled):
            token = result.token_ids[row]
            req.append_output_token_ids(token)
            self.num_generation_tokens += 1
            if req.first_token_time is None:
                req.first_token_time = now
            group, idx = self._child_of[req.request_id]
            wants = result.logprobs is not None and req.sampling_params.logprobs is not None
            done = group.states[idx].update(
                req, token, self.eos_ids, self.max_model_len,
                result.logprobs[row] if wants else None,
                result.top_logprobs[row] if wants else None,
                result.ranks[row] if wants else None)
            if done:
                req.finished_time = now
                self.scheduler.finish(req, status_for(group.states[idx].finish_reason))
            touched[group.request_id] = group
        outputs = []
        for group in touched.values():
            out = self._output(group)
            outputs.append(out)
            if out.finished:
                del self._groups[group.request_id]
                for child in group.children:
                    self._forget(child)
        return outputs

    def _wants_prompt_logprobs(self, req: Request, start: int) -> bool:
        """Child 0 of a group that asked for prompt logprobs, on a chunk that still has prompt
        positions to score (positions already scored before a preemption are not redone)."""
        if not req.skip_prefix_cache_read:
            return False
        group = self._child_of[req.request_id][0]
        return len(group.prompt_logprobs) < req.num_prompt_tokens

    PROMPT_LOGITS_SLICE = 256  # rows of vocab-sized logits alive at once

    def _score_prompt(self, req: Request, start: int, hidden) -> None:
        """Row r of `hidden` (position start + r) predicts prompt token start + r + 1."""
        group = self._child_of[req.request_id][0]
        out = group.prompt_logprobs
        prompt = req.prompt_token_ids
        k = req.sampling_params.prompt_logprobs
        first = len(out) - 1 - start  # first row not scored yet
        last = min(len(hidden), len(prompt) - 1 - start)  # rows that predict a prompt token
        for a in range(max(first, 0), last, self.PROMPT_LOGITS_SLICE):
            b = min(last, a + self.PROMPT_LOGITS_SLICE)
            targets = prompt[start + a + 1:start + b + 1]
            lps, ranks, tops = score_tokens(self.runner.compute_logits(hidden[a:b]), targets, k)
            for tok, lp, rank, top in zip(targets, lps, ranks, tops):
                out.append(logprob_entry(self.tokenizer, tok, lp, rank, top))

    def _fail_batch(self, requests: list[Request]) -> None:
        """The model failed mid-step: the batch's new blocks were entered in the cache table but
        hold no valid KV. Abort the batch and forget identities so no later request hits them."""
        for req in requests:
            group = self._child_of.get(req.request_id, (None, 0))[0]
            if group is not None:
                self.abort_request(group.request_id)
        if not self.kv_cache_manager.reset_prefix_cache():
            for req in list(self.scheduler.running):  # others hold blocks: drop everything
                group = self._child_of.get(req.request_id, (None, 0))[0]
                if group is not None:
                    self.abort_request(group.request_id)
            self.kv_cache_manager.reset_prefix_cache()

    def _output(self, group: _Group) -> RequestOutput:
        first = group.children[0]
        finished = all(c.is_finished for c in group.children)
        first_token = min((c.first_token_time for c in group.children if c.first_token_time), default=None)
        metrics = RequestMetrics(
            arrival_time=group.arrival_time, first_scheduled_time=first.first_scheduled_time,
            first_token_time=first_token, last_token_time=time.time(),
            finished_time=max((c.finished_time or 0.0) for c in group.children) if finished else None)
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
            outputs=[s.completion(c) for s, c in zip(group.states, group.children)],
            finished=finished, num_cached_tokens=max(first.num_cached_tokens, 0), metrics=metrics,
            prompt_logprobs=group.prompt_logprobs)

    # -- cache control and statistics ----------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    @property
    def prefix_cache_stats(self):
        return self.kv_cache_manager.stats

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage
