"""Turns a `SchedulerOutput` into tensors - token ids, positions, slot mapping, block tables - runs
the model, samples the next tokens and scores prompt logprobs, and returns a `PendingOutput` whose
`result()` is the step's `ModelRunnerOutput` (the tokens read from the device only then).
Knows nothing of hashing; the per-block tensors it reads are the `BlockTensors` registry's.

Sampling lives here (as in vLLM): the logits never leave the runner. A request whose sampling
fails (or whose logits are not finite) is reported in `errors` and the rest of the batch samples
as if it were not there.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..constraints.device_masks import step_masks
from ..lora.manager import LoRAManager
from ..memory.block_tensors import BlockTensors
from ..memory.kv_groups import KVCacheGroups
from ..model import AttentionMetadata, LoadedModel
from ..model.host_copy import HostCopies, tensor_on, to_device
from ..stage_outputs.specs import per_token_outputs
from ..tiers import NULL_WORKER_CONNECTOR, WorkerConnector
from .block_table_tensor import padded_block_tables
from .graph_sampling import RULED_OUT
from .model_runner_output import ModelRunnerOutput
from .pending_output import PendingOutput, PromptScores
from .sampler import (
    SampledTensors,
    SampleResult,
    apply_penalties,
    plain_greedy,
    rows_finite,
    sample,
    score_rows,
)
from .scheduler_output import ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from ..multimodal.embedding import MultiModalEmbedder
    from ..stage_outputs import StageOutputCache
    from .cuda_graphs import DecodeTail, StepGraphs

PROMPT_LOGITS_SLICE = 256  # rows of vocab-sized logits alive at once when scoring a prompt


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        block_tensors: BlockTensors,
        dtype: torch.dtype,
        device: torch.device,
        default_generator: torch.Generator | None = None,
        lora_manager: LoRAManager | None = None,
        *,
        kv_connector: WorkerConnector = NULL_WORKER_CONNECTOR,
        stage_outputs: StageOutputCache | None = None,
        mm: MultiModalEmbedder | None = None,
        block_size: int | None = None,
        kv_groups: KVCacheGroups | None = None,
        graphs: StepGraphs | None = None,
        defer_reads: bool = False,
    ) -> None:
        """`kv_connector`: the worker half of the KV tiers (prefixkv/tiers); the null one without
        tiers, which no step asks for anything. `stage_outputs`: the scheduler's stage-output
        cache, when on. `mm`: the image embedder of a vision-language model. `block_size`: tokens
        per block (None: the K/V tensors' block axis; a recurrent model's state has none).
        `kv_groups`: a hybrid model's KV-cache groups (memory/kv_groups.py), None: one group.
        `graphs`: steps over fixed buffers, captured as CUDA graphs (cuda_graphs.py), built
        over the same KV tensors; None: every step eager. `defer_reads`: a step's logits are checked
        for non-finite rows when its tokens are read, not before sampling (async scheduling: the
        host must not wait for the device between launching a step and launching the next)."""
        self.model = loaded.model
        if device.type == "cpu":
            self.model.pack_for_cpu()  # weights laid out once for the CPU's fastest matmuls
        self.config = loaded.config
        self.block_tensors = block_tensors
        if not block_tensors.num_blocks:
            raise ValueError("allocate the block tensors before building the runner")
        if block_size is None:
            block_size = block_tensors.kv_caches[0].shape[2]
        self.block_size = block_size
        # per layer what the model reads and writes: K/V tensors, or a recurrent layer's state
        self.kv_caches = block_tensors.layer_caches(self.config, block_size, kv_groups)
        self.layer_groups = kv_groups.layer_group(self.config.num_hidden_layers) if kv_groups is not None else None
        self.device = device
        # constraints as one bitmask a step (constraints/device_masks.py) or row by row on the
        # host; None: the bitmask on a GPU (tests and bench/host_overhead.py --gpu-path set True
        # to stand in for one on a CPU)
        self.constraint_masks: bool | None = None
        self.eos_token_ids = set(loaded.tokenizer.eos_token_ids)
        self.default_generator = default_generator or torch.Generator().manual_seed(0)
        self.stage_outputs = stage_outputs
        self.kv_connector = kv_connector
        self.mm = mm
        self.lora_manager = lora_manager
        if lora_manager is not None:
            lora_manager.attach(self.model)  # after packing: the wrappers call the packed base layers
        self.graphs = graphs
        self.defer_reads = defer_reads

    def graph_kind(self, scheduled: list[ScheduledRequest]) -> str | None:
        """Which captured step a step replays ("decode", "mixed"; None: it runs eagerly): its shape
        within the graphs' sizes, and no request needing what a graph does not compute - image
        inputs where its graphs take none (`StepGraphs.takes_images`), a LoRA adapter where they
        were captured without LoRA. Prompt logprobs,
        hidden states and the stage-output cache read a replayed step's final hidden states as an
        eager step's, outside the graph."""
        graphs = self.graphs
        if graphs is None:
            return None
        kind = graphs.kind(scheduled)
        if kind is None:
            return None
        lora_eager = not graphs.takes_lora(kind)
        images_eager = not graphs.takes_images(kind)
        if any((lora_eager and sr.lora_id) or (images_eager and sr.mm_inputs) for sr in scheduled):
            return None
        return kind

    def decoder_layers(self) -> list[nn.Module]:
        """The model's decoder layers, in the order each forward calls them (none for a model
        without a `layers` list)."""
        layers = getattr(self.model, "layers", None)
        return list(layers) if isinstance(layers, nn.ModuleList) else []

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput, previous: PendingOutput | None = None) -> PendingOutput:
        """Compute every scheduled chunk; sample for the requests with `sample` set and score the
        prompt positions of those with `want_hidden_states`. Raises only when the forward pass
        itself fails (then no KV written in this step can be trusted). The sampled tokens stay
        where they were drawn until `PendingOutput.result()` reads them: on a GPU the host goes on
        while the device computes (with `defer_reads`, nothing in a greedy step waits for it).
        Rows scheduled with `input_from_previous` read their input token from `previous`'s draws
        on the device."""
        scheduled = scheduler_output.scheduled
        dev = self.device
        pending = PendingOutput(ModelRunnerOutput())
        if scheduler_output.kv_loads:  # blocks from the tiers, before the forward reads them
            loads = self.kv_connector.load(scheduler_output.kv_loads)
            if previous is None:  # every step before is booked: their stage rows go in now, readable
                loads.finish()
                if self.stage_outputs is not None:
                    self.stage_outputs.commit([load.block_id for load in scheduler_output.kv_loads])
            else:  # after the rows of the steps booked before it (stage_outputs/store.py)
                pending.kv_loads = loads
        carried = self._carried_inputs(scheduled, previous)
        # each request's first row (None: row i is request i's, a replayed decode)
        query_start_loc: list[int] | None
        kind = self.graph_kind(scheduled)
        tail: DecodeTail | None = None  # a replayed decode's logits, row checks and argmax
        if kind is not None:
            assert self.graphs is not None
            lora_slots = None
            if self.lora_manager is not None and any(sr.lora_id for sr in scheduled):
                lora_slots = self.lora_manager.slots_for([sr.lora_id for sr in scheduled])
            hidden, query_start_loc = self.graphs.run(scheduled, carried, kind, lora_slots, self._spliced(scheduled))
            slots = self.graphs.step_slots(kind, hidden.shape[0])
            tail = self.graphs.decode_tail(hidden.shape[0]) if kind == "decode" else None
        else:
            # on a CPU a verifying request's positions run as decodes of their own (`_as_decode_rows`)
            as_decodes = bool(scheduler_output.num_draft_tokens) and dev.type == "cpu"
            output_rows = self._output_rows(scheduler_output)
            hidden, query_start_loc, slots = self._forward(scheduled, carried, as_decodes, output_rows)
        if self.stage_outputs is not None:  # every computed row, through the KV slot mapping
            pending.stage_rows = self.stage_outputs.stage(per_token_outputs(hidden, hidden.shape[0]), slots)
        starts = query_start_loc if query_start_loc is not None else range(len(scheduled) + 1)
        out = pending.out
        if scheduler_output.kv_saves:  # completed blocks (and their stage rows), for the tiers
            pending.kv_saves = self.kv_connector.save(scheduler_output.kv_saves)
        if any(sr.want_hidden_states for sr in scheduled):  # computed before a replay overwrites them
            for i, sr in enumerate(scheduled):
                if sr.want_hidden_states:
                    try:
                        self._prompt_outputs(sr, hidden[starts[i] : starts[i + 1]], pending)
                    except Exception as e:  # noqa: BLE001 (this request fails alone)
                        what = (
                            "scoring prompt logprobs"
                            if sr.sampling_params.prompt_logprobs is not None
                            else "hidden states"
                        )
                        out.errors[sr.req_id] = f"{what} failed: {e}"
        errors = out.errors
        to_sample = [sr for sr in scheduled if sr.sample and sr.req_id not in errors]
        if to_sample:
            if tail is not None and len(to_sample) == hidden.shape[0]:
                self._sample(tail.logits, to_sample, pending, previous, tail)  # the graph ran the LM head
                return pending
            if scheduler_output.num_draft_tokens:  # a row after each draft too (prefixkv/speculative)
                rows, to_sample = _verify_rows(scheduled, starts, errors)
                hidden = hidden[tensor_on(rows, dev, torch.long)]
                pending.drafts = {sr.req_id: sr.draft_token_ids for sr in scheduled if sr.draft_token_ids}
                pending.generator_states = _seeded_states(scheduled)
            # every row sampled (or the model returned the sampled rows alone: `_output_rows`):
            # the hidden states as they are, no gather
            elif len(to_sample) != hidden.shape[0]:
                rows = [starts[i + 1] - 1 for i, sr in enumerate(scheduled) if sr.sample and sr.req_id not in errors]
                hidden = hidden[tensor_on(rows, dev, torch.long)]
            logits = self.model.compute_logits(hidden).float()  # sampled where it lies
            self._sample(logits, to_sample, pending, previous)
        return pending

    @staticmethod
    def _outputs_so_far(
        to_sample: list[ScheduledRequest], previous: PendingOutput | None
    ) -> dict[str, list[int]] | None:
        """The output tokens of the requests scheduled ahead whose sampling reads them (penalties,
        constraints: bad words, a grammar), the one the previous step drew for each included (its
        host list lacks it until that step is booked), read from the previous step's copy: that
        waits for the previous step alone, not for this step's forward, launched already. None
        where no row needs it."""
        ahead = [
            sr
            for sr in to_sample
            if sr.input_from_previous and (sr.sampling_params.penalized or sr.constraints is not None)
        ]
        if not ahead:
            return None
        if previous is None:
            raise RuntimeError("a step reads the previous step's tokens, but there is no previous step")
        drawn = previous.result()
        token_of = dict(zip(drawn.req_ids, drawn.sampled_token_ids))
        # a request missing there failed in that step: its token here is dropped with it
        return {sr.req_id: [*sr.output_token_ids, token_of[sr.req_id]] for sr in ahead if sr.req_id in token_of}

    def _carried_inputs(
        self, scheduled: list[ScheduledRequest], previous: PendingOutput | None
    ) -> tuple[list[int], torch.Tensor] | None:
        """The rows of this step whose input token the previous step is drawing, and those tokens
        on the device (None: every input id is on the host)."""
        rows = [i for i, sr in enumerate(scheduled) if sr.input_from_previous]
        if not rows:
            return None
        if previous is None:
            raise RuntimeError("a step reads the previous step's tokens, but there is no previous step")
        return rows, previous.tokens_of([scheduled[i].req_id for i in rows], self.device)

    def _spliced(self, scheduled: list[ScheduledRequest]) -> list[tuple[int, torch.Tensor]] | None:
        """A replayed step's image rows (first row in the step, the encoder's rows; None: no
        image in the step); the encoder runs here, outside the graph."""
        if self.mm is None or not any(sr.mm_inputs for sr in scheduled):
            return None
        placements, row = [], 0
        for sr in scheduled:  # a replayed step's rows are its requests' in order, as an eager step's
            if sr.mm_inputs:
                placements.append((row, sr.mm_inputs))
            row += len(sr.token_ids)
        return self.mm.spliced_rows(placements)

    @torch.inference_mode()
    def eager_hidden(self, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        """The final hidden states of a step run eagerly, whatever graphs there are (what a replay
        is compared and timed against: graph_check.py, mixed_graph_choice.py)."""
        return self._forward(scheduled)[0]

    def _output_rows(self, scheduler_output: SchedulerOutput) -> list[int] | None:
        """The rows whose final hidden states a step reads, where those are the sampled requests'
        last rows alone (AttentionMetadata.output_rows): None where every row is read (the
        stage-output cache stores each, prompt logprobs and hidden states score each, drafts are
        verified at each)."""
        scheduled = scheduler_output.scheduled
        if (
            not self.model.reads_output_rows
            or self.stage_outputs is not None
            or scheduler_output.num_draft_tokens
            or any(sr.want_hidden_states for sr in scheduled)
        ):
            return None
        ends = itertools.accumulate(len(sr.token_ids) for sr in scheduled)
        return [end - 1 for sr, end in zip(scheduled, ends) if sr.sample]

    def _forward(
        self,
        scheduled: list[ScheduledRequest],
        carried: tuple[list[int], torch.Tensor] | None = None,
        as_decodes: bool = False,
        output_rows: list[int] | None = None,
    ) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """The eager forward of any step: its final hidden states (every row's, or where the model
        takes `output_rows`, those rows' alone), each request's first row and its rows' KV slots.
        `carried`: rows whose one input token is on the device already (`_carried_inputs`).
        `as_decodes`: requests with drafts attend as one decode a position."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        attention_rows = _as_decode_rows(scheduled) if as_decodes else scheduled
        for sr in attention_rows:
            start, table = sr.start, sr.block_table
            end = start + len(sr.token_ids)
            input_ids.extend(sr.token_ids)
            if end - start == 1:  # a decode: one position, one slot
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                positions.extend(range(start, end))
                _extend_slots(slots, table, start, end, bs)
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
        dev = self.device
        tables = padded_block_tables([sr.block_table for sr in attention_rows], torch.long)
        meta = AttentionMetadata(
            slot_mapping=tensor_on(slots, dev, torch.long),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=to_device(tables, dev),
            host_block_tables=tables if dev.type != "cpu" else None,
            output_rows=output_rows,
        )
        if self.layer_groups is not None:  # the later KV-cache groups' own blocks
            for g in range(len(scheduled[0].group_block_tables)):
                group_tables = [sr.group_block_tables[g] for sr in attention_rows]
                group_slots: list[int] = []
                for sr, table in zip(attention_rows, group_tables):
                    _extend_slots(group_slots, table, sr.start, sr.start + len(sr.token_ids), bs)
                group_slot_tensor = tensor_on(group_slots, dev, torch.long)
                group_tensor = to_device(padded_block_tables(group_tables, torch.long), dev)
                meta.group_tables.append((group_slot_tensor, group_tensor))
            meta.layer_groups = self.layer_groups
        extra: dict[str, object] = {}
        if self.lora_manager is not None and any(sr.lora_id for sr in scheduled):
            # the per-token adapter index, grouped by adapter (base-only steps skip this entirely)
            extra["lora_mapping"] = self.lora_manager.prepare([(sr.lora_id, len(sr.token_ids)) for sr in scheduled])
        if attention_rows is not scheduled:  # (the meta keeps the rows'): each request's first row
            query_start_loc = list(itertools.accumulate((len(sr.token_ids) for sr in scheduled), initial=0))
        ids = tensor_on(input_ids, dev, torch.long)
        if carried is not None:
            rows, tokens = carried
            ids[tensor_on([query_start_loc[i] for i in rows], dev, torch.long)] = tokens
        if self.mm is not None and any(sr.mm_inputs for sr in scheduled):
            # image embeddings at the placeholder positions; the model only sees the embeddings
            placements = [(query_start_loc[i], sr.mm_inputs) for i, sr in enumerate(scheduled) if sr.mm_inputs]
            extra["inputs_embeds"] = self.mm.inputs_embeds(self.model.embed_tokens, ids, placements)
        pos = tensor_on(positions, dev, torch.long)
        hidden = self.model(ids, pos, self.kv_caches, meta, **extra)
        return hidden, query_start_loc, meta.slot_mapping

    # -- sampling ------------------------------------------------------------------------------
    def _sample(
        self,
        logits: torch.Tensor,
        reqs: list[ScheduledRequest],
        pending: PendingOutput,
        previous: PendingOutput | None,
        tail: DecodeTail | None = None,
    ) -> None:
        """`previous`: the step before, whose tokens the penalties of rows scheduled ahead read
        (`_outputs_so_far`). `tail`: what the replayed graph computed of these rows (`logits`
        its): its row checks, its argmax where that is every token (sampler.plain_greedy), and its
        graphs' draws where they take the rows (`_draws_in_graph`)."""
        finite = tail.finite if tail is not None else rows_finite(logits)
        out = pending.out
        greedy = all(sr.sampling_params.greedy for sr in reqs)
        whole = tail is not None and len(reqs) == tail.tokens.shape[0]  # every row of the replay
        argmax = whole and self._takes_argmax(reqs)
        in_graph = whole and not argmax and self._draws_in_graph(reqs)
        if self.defer_reads:
            # checked when the tokens are read, and a broken row's token dropped then. A random draw
            # from it would raise, so it draws from zeros (the graphs' draws too); an argmax never
            # raises: a batch of greedy rows skips that pass over its logits
            if not greedy and not in_graph:
                logits = torch.where(finite[:, None], logits, 0.0)
            pending.finite = finite
        elif not bool(finite.all()):  # a broken row fails its request, not the batch
            keep = finite.tolist()
            for sr, ok in zip(reqs, keep):
                if not ok:
                    out.errors[sr.req_id] = "the model produced non-finite logits"
            reqs = [sr for sr, ok in zip(reqs, keep) if ok]
            if not reqs:
                return
            logits = logits[torch.tensor(keep, device=logits.device)]
            argmax = in_graph = False  # fewer rows than the graph's
        edited = in_graph and any(
            sr.constraints is not None or sr.block_eos or sr.sampling_params.penalized for sr in reqs
        )
        raw = None  # the raw logits of edited rows, for their scores
        if edited:
            assert tail is not None and self.graphs is not None
            if any(sr.sampling_params.logprobs is not None for sr in reqs):
                raw = self.graphs.keep_raw(len(reqs))
            in_graph = self._edit_for_graph(tail.logits, reqs, previous)
            if not in_graph and self.defer_reads and not greedy:
                logits = torch.where(finite[:, None], logits, 0.0)  # as above, for the eager draws
        if argmax:
            assert tail is not None
            marked = tail.marked if pending.finite is not None else None
            pending.sampled = SampledTensors(tail.tokens, len(reqs), marked=marked)
            pending.req_ids = [sr.req_id for sr in reqs]
            pending.start_reading()
            return
        if in_graph:
            assert self.graphs is not None
            gens = [sr.generator or self.default_generator for sr in reqs]
            pending.sampled = self.graphs.draw([sr.sampling_params for sr in reqs], gens, raw)
            if edited:  # the draws saw edited rows: the raw logits' check marks them when read
                pending.sampled.marked = None
            pending.req_ids = [sr.req_id for sr in reqs]
            pending.start_reading()
            return
        gens = [sr.generator or self.default_generator for sr in reqs]
        outputs = self._outputs_so_far(reqs, previous)
        states: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        try:
            if not greedy:
                # a failed batch is redone row by row from the same generator states
                states = {id(g): (g, g.get_state()) for g in gens}
            pending.sampled = self._sample_rows(logits, reqs, gens, outputs)
        except Exception:  # noqa: BLE001 (find the failing rows one by one)
            for g, state in states.values():
                g.set_state(state)
            if pending.finite is not None:  # read now: the broken rows are dropped before the retry
                keep = pending.finite.tolist()
                pending.finite = None
                for sr, ok in zip(reqs, keep):
                    if not ok:
                        out.errors[sr.req_id] = "the model produced non-finite logits"
                ok_rows = [i for i, ok in enumerate(keep) if ok]
                reqs, gens = [reqs[i] for i in ok_rows], [gens[i] for i in ok_rows]
                logits = logits[torch.tensor(ok_rows, dtype=torch.long, device=logits.device)]
            pending.sampled = self._sample_one_by_one(logits, reqs, gens, out, outputs)
            reqs = [sr for sr in reqs if sr.req_id not in out.errors]
        pending.req_ids = [sr.req_id for sr in reqs]
        pending.start_reading()  # before the engine launches a next step (async scheduling)

    def _draws_in_graph(self, reqs: list[ScheduledRequest]) -> bool:
        """Whether the replayed decode step's graphs draw these rows' tokens (StepGraphs.draw; the
        caller takes plain greedy rows from the tail's argmax first). Penalties, constraints and
        blocked EOS ids edit the graph's logits first (`_edit_for_graph`; the raw ones kept aside
        where a row asks for logprobs, which are theirs): constraints where they are one bitmask."""
        graphs = self.graphs
        if graphs is None:
            return False
        if not self._masks_on_device() and any(sr.constraints is not None or sr.block_eos for sr in reqs):
            return False
        return graphs.samples([sr.sampling_params for sr in reqs])

    def _masks_on_device(self) -> bool:
        """Whether constraints are one bitmask a step (constraints/device_masks.py): where asked,
        else on a GPU."""
        return self.device.type != "cpu" if self.constraint_masks is None else self.constraint_masks

    def _edit_for_graph(
        self, logits: torch.Tensor, reqs: list[ScheduledRequest], previous: PendingOutput | None
    ) -> bool:
        """Edit a replayed step's logits in place for its draws' graph, as `sample` edits its copy:
        the penalties, then the constraints and blocked EOS ids, every token ruled out set to
        RULED_OUT, which that graph draws as `sample` draws -inf. False, nothing edited, where a
        row has nothing left (the eager path then finds it)."""
        outputs = _outputs_of(reqs, self._outputs_so_far(reqs, previous))
        masks = None
        if any(sr.constraints is not None or sr.block_eos for sr in reqs):
            eos = self.eos_token_ids
            try:
                masks = step_masks(
                    len(reqs),
                    logits.shape[1],
                    [sr.constraints for sr in reqs],
                    outputs,
                    [eos if sr.block_eos else None for sr in reqs],
                )
            except ValueError:
                return False
        params = [sr.sampling_params for sr in reqs]
        penalized = [row for row, p in enumerate(params) if p.penalized]
        if penalized:
            apply_penalties(logits, penalized, params, [sr.prompt_token_ids for sr in reqs], outputs)
        if masks is not None:
            masks.apply(logits, RULED_OUT)
        return True

    @staticmethod
    def _takes_argmax(reqs: list[ScheduledRequest]) -> bool:
        """Whether these rows' tokens are their logits' argmax alone, as `sample` would draw them:
        plain greedy, no constraints, no EOS blocked (min_tokens)."""
        params = [sr.sampling_params for sr in reqs]
        return plain_greedy(params) and all(sr.constraints is None and not sr.block_eos for sr in reqs)

    def _sample_rows(
        self,
        logits: torch.Tensor,
        reqs: list[ScheduledRequest],
        gens: list[torch.Generator],
        outputs: dict[str, list[int]] | None,
    ) -> SampledTensors:
        eos = self.eos_token_ids
        eos_block = [eos if sr.block_eos else None for sr in reqs]
        constraints = [sr.constraints for sr in reqs]
        return sample(
            logits,
            [sr.sampling_params for sr in reqs],
            gens,  # type: ignore[arg-type]
            [sr.prompt_token_ids for sr in reqs],
            _outputs_of(reqs, outputs),
            eos_block if any(e is not None for e in eos_block) else None,
            constraints if any(c is not None for c in constraints) else None,
            as_masks=self._masks_on_device(),
        )

    def _sample_one_by_one(
        self,
        logits: torch.Tensor,
        reqs: list[ScheduledRequest],
        gens: list[torch.Generator],
        out: ModelRunnerOutput,
        outputs: dict[str, list[int]] | None,
    ) -> SampleResult:
        """Find the rows that fail; the others keep what they sample."""
        results: list[SampleResult] = []
        for row, sr in enumerate(reqs):
            try:
                results.append(self._sample_rows(logits[row : row + 1], [sr], gens[row : row + 1], outputs).result())
            except Exception as e:  # noqa: BLE001 (this request fails alone)
                out.errors[sr.req_id] = f"sampling failed: {type(e).__name__}: {e}"
        merged = SampleResult([r.token_ids[0] for r in results], None, None)
        if any(r.logprobs is not None for r in results):
            # rows that asked for none still get their sampled token's logprob (as in a batch)
            merged.logprobs = [r.logprobs[0] if r.logprobs else 0.0 for r in results]
            merged.ranks = [r.ranks[0] if r.ranks else 1 for r in results]
            merged.top_logprobs = [r.top_logprobs[0] if r.top_logprobs else [] for r in results]
        return merged

    # -- prompt outputs: logprobs and hidden states ----------------------------------------------
    def _prompt_outputs(self, sr: ScheduledRequest, hidden: torch.Tensor, pending: PendingOutput) -> None:
        """Prompt logprobs and hidden states of one chunk (the prompt's; with return_hidden_states
        the generated positions' too), preceded by the cached hidden states of the hit blocks in
        `sr.stage_output_reads` (stage-output cache). Both are read with the step's tokens
        (PendingOutput.result): nothing here waits for the device."""
        start = sr.start
        if sr.stage_output_reads:
            if self.stage_outputs is None:
                raise RuntimeError("stage-output reads scheduled but the stage-output cache is off")
            cached = self.stage_outputs.read(sr.stage_output_reads, hidden.dtype, device=hidden.device)
            start -= len(cached)
            hidden = torch.cat([cached, hidden])
        if sr.sampling_params.prompt_logprobs is not None:
            scored = self._score_prompt(sr, start, hidden)
            if scored is not None:
                pending.prompt_scores[sr.req_id] = scored
        if sr.prompt_hidden_from is not None:
            a = max(sr.prompt_hidden_from, start)
            b = start + len(hidden)
            if not sr.sampling_params.return_hidden_states:
                b = min(b, len(sr.prompt_token_ids))
            if a < b:
                rows = hidden[a - start : b - start]
                # copied in stream order on a GPU; on a CPU a copy, so that no later step can rewrite them
                pending.hidden_states[sr.req_id] = (a, HostCopies([rows if rows.is_cuda else rows.clone()]))

    def _score_prompt(self, sr: ScheduledRequest, start: int, hidden: torch.Tensor) -> PromptScores | None:
        """Row r of `hidden` (position start + r) predicts prompt token start + r + 1; rows
        whose target was scored before (a preemption recomputes them) are skipped. PROMPT_LOGITS_SLICE
        rows' logits at a time, each slice's scores copied to the host as soon as computed."""
        prompt = sr.prompt_token_ids
        k = sr.sampling_params.prompt_logprobs or 0
        first = max(sr.prompt_logprobs_from - 1 - start, 0)  # first row not scored yet
        last = min(len(hidden), len(prompt) - 1 - start)  # rows that predict a prompt token
        if first >= last:
            return None
        scores: list[torch.Tensor] = []
        for a in range(first, last, PROMPT_LOGITS_SLICE):
            b = min(last, a + PROMPT_LOGITS_SLICE)
            logits = self.model.compute_logits(hidden[a:b]).float()
            targets = tensor_on(prompt[start + a + 1 : start + b + 1], logits.device, torch.long)
            chosen, ranks, values, ids = score_rows(logits, targets, k)
            scores += [chosen, ranks, values, ids] if k else [chosen, ranks]
        return PromptScores(start + first + 1, k, HostCopies(scores))


def _extend_slots(slots: list[int], table: list[int], start: int, end: int, bs: int) -> None:
    """Append the cache slots of positions [start, end) through a block table: whole runs per
    block, not one lookup per token."""
    pos = start
    while pos < end:
        block_end = min(end, (pos // bs + 1) * bs)
        base = table[pos // bs] * bs - (pos // bs) * bs
        slots.extend(range(base + pos, base + block_end))
        pos = block_end


@dataclass(slots=True)
class _DecodeRow:
    """One position of a verifying request, attended as a decode of its own (`_as_decode_rows`)."""

    start: int
    token_ids: list[int]
    block_table: list[int]
    group_block_tables: list[list[int]]


def _as_decode_rows(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest | _DecodeRow]:
    """A step's attention rows with each request that verifies drafts split into one decode per
    position, over the same blocks: position p reads positions 0..p, those written in this step
    included (every kernel writes a layer's K/V rows before it attends), which is what a query
    chunk computes - but a step of decodes alone takes the one-call decode kernel, where a chunk
    of 5 positions took 1.39x a decode step's time and 5 decodes 1.09x (default model, float32,
    500-token context, a 2-vCPU AMD EPYC Zen 4)."""
    rows: list[ScheduledRequest | _DecodeRow] = []
    for sr in scheduled:
        if not sr.draft_token_ids:
            rows.append(sr)
            continue
        table, groups = sr.block_table, sr.group_block_tables
        rows.extend(_DecodeRow(sr.start + j, [t], table, groups) for j, t in enumerate(sr.token_ids))
    return rows


def _verify_rows(
    scheduled: list[ScheduledRequest], starts: Sequence[int], errors: dict[str, str]
) -> tuple[list[int], list[ScheduledRequest]]:
    """The rows to sample of a step with drafts, and what each is sampled as: a request with k
    drafts samples its last k + 1 rows, row j as the request with its first j drafts appended to
    its output (what its penalties count, and whether min_tokens still blocks EOS there)."""
    rows: list[int] = []
    as_requests: list[ScheduledRequest] = []
    for i, sr in enumerate(scheduled):
        if not sr.sample or sr.req_id in errors:
            continue
        end = starts[i + 1]
        drafts = sr.draft_token_ids
        k = len(drafts)
        rows.extend(range(end - 1 - k, end))
        as_requests.append(sr)
        if not k:
            continue
        params = sr.sampling_params
        n_out = len(sr.output_token_ids)
        for j in range(1, k + 1):
            block_eos = n_out + j < params.min_tokens
            if params.penalized or block_eos != sr.block_eos:
                out = [*sr.output_token_ids, *drafts[:j]]
                as_requests.append(replace(sr, output_token_ids=out, block_eos=block_eos))
            else:  # its sampling reads nothing of the tokens before it
                as_requests.append(sr)
    return rows, as_requests


def _seeded_states(scheduled: list[ScheduledRequest]) -> dict[str, tuple[torch.Generator, torch.Tensor]] | None:
    """The state before the step of each drawing, drafting request's own generator (accept.py)."""
    states = {
        sr.req_id: (sr.generator, sr.generator.get_state())
        for sr in scheduled
        if sr.draft_token_ids and sr.generator is not None and not sr.sampling_params.greedy
    }
    return states or None


def _outputs_of(reqs: list[ScheduledRequest], outputs: dict[str, list[int]] | None) -> list[list[int]]:
    """Each row's output so far, the token in flight included where `outputs` has it
    (ModelRunner._outputs_so_far)."""
    if outputs is None:
        return [sr.output_token_ids for sr in reqs]
    return [outputs.get(sr.req_id, sr.output_token_ids) for sr in reqs]
