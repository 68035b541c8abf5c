"""The scheduler without a model: what crosses the scheduler -> runner boundary each step
(SchedulerOutput) and how a ModelRunnerOutput is booked. The runner's side is written by hand
here - it is the typed contract itself, not a stand-in for the model."""

from __future__ import annotations

import torch

from prefixkv.engine.model_runner_output import ModelRunnerOutput
from prefixkv.engine.scheduler import Scheduler
from prefixkv.memory.block_tensors import BlockTensors, BlockTensorSpec
from prefixkv.request import Request, RequestStatus
from prefixkv.sampling_params import SamplingParams
from prefixkv.stage_outputs.specs import HIDDEN_STATES, spec_name


def make(num_blocks: int = 8, budget: int = 10) -> Scheduler:
    return Scheduler(num_blocks=num_blocks, block_size=4, max_num_seqs=4, max_num_batched_tokens=budget)


def req(rid: str, n: int, **params) -> Request:
    first = 1000 * (ord(rid) - ord("a") + 1)  # distinct prompts: no prefix-cache hits between them
    return Request(rid, list(range(first, first + n)), sampling_params=SamplingParams(**params))


def test_chunked_prefill_then_decode_crosses_as_typed_steps():
    s = make()
    a, b = req("a", 7), req("b", 6, min_tokens=2)
    s.add_request(a)
    s.add_request(b)
    step = s.schedule()
    assert [(x.req_id, x.start, len(x.token_ids), x.sample) for x in step.scheduled] == [
        ("a", 0, 7, True),
        ("b", 0, 3, False),
    ]  # b's prompt is chunked by the token budget
    assert step.num_scheduled_tokens == 10 and step.scheduled[0].block_table == [0, 1]
    assert step.scheduled[1].block_eos  # min_tokens not reached
    sampled, failed = s.update_from_output(step, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[5]))
    assert sampled == [a] and not failed
    assert (a.num_computed_tokens, a.output_token_ids, b.num_computed_tokens) == (7, [5], 3)
    step = s.schedule()
    assert [(x.req_id, x.start, x.token_ids, x.sample) for x in step.scheduled] == [
        ("a", 7, [5], True),
        ("b", 3, [2003, 2004, 2005], True),
    ]


def test_a_failed_request_is_finished_and_its_blocks_freed():
    s = make()
    a, b = req("a", 5), req("b", 5)
    s.add_request(a)
    s.add_request(b)
    step = s.schedule()
    _, failed = s.update_from_output(
        step, ModelRunnerOutput(req_ids=["b"], sampled_token_ids=[1], errors={"a": "boom"})
    )
    assert failed == [a] and a.status is RequestStatus.FINISHED_ERROR and a.error == "boom"
    assert "a" not in s.requests and s.running == [b]
    assert s.schedule().finished_req_ids == ["a"]  # the runner hears who left
    s.finish_request(b, RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.num_free_blocks == 8 and s.num_unfinished == 0


def test_preemption_is_reported_and_the_victim_recomputes():
    s = make(num_blocks=4, budget=64)
    a, b = req("a", 8), req("b", 7)
    s.add_request(a)
    s.add_request(b)
    step = s.schedule()  # a takes 2 blocks (+ room), b 2
    s.update_from_output(step, ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[1, 2]))
    step = s.schedule()  # a needs a third block: b, the newest, is preempted
    assert step.preempted_req_ids == ["b"] and [x.req_id for x in step.scheduled] == ["a"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and s.num_preemptions == 1


def test_one_budget_counts_every_per_block_tensor():

    kv = BlockTensorSpec("kv.0", (2, 4, 1, 8), torch.float32, block_dim=1)
    extra = BlockTensorSpec("hidden.0", (4, 16), torch.float32)
    alone, both = BlockTensors([kv]), BlockTensors([kv, extra])
    assert alone.bytes_per_block == 2 * 4 * 8 * 4 and both.bytes_per_block == alone.bytes_per_block + 4 * 16 * 4
    budget = 10 * both.bytes_per_block
    assert both.num_blocks_for(budget) == 10 < alone.num_blocks_for(budget)
    both.allocate(10, "cpu")
    assert both.tensors["kv.0"].shape == (2, 10, 4, 1, 8) and both.tensors["hidden.0"].shape == (10, 4, 16)
    assert both.kv_caches == [both.tensors["kv.0"]]


def test_a_decode_scheduled_ahead_carries_every_field_by_name():
    """ScheduledRequest.next_decode builds positionally: every field is checked here by name, so a
    field added or moved in the dataclass cannot land in another's place."""
    from dataclasses import fields

    from prefixkv.engine.scheduler_output import ScheduledRequest

    prompt, output = [1, 2, 3], [4]
    given = dict(
        req_id="a",
        token_ids=[1, 2, 3],
        start=0,
        block_table=[5],
        sample=False,
        sampling_params=SamplingParams(temperature=0.5),
        generator=object(),
        prompt_token_ids=prompt,
        output_token_ids=output,
        block_eos=True,
        constraints="c",
        want_hidden_states=True,
        prompt_logprobs_from=1,
        prompt_hidden_from=2,
        lora_id=3,
        mm_inputs=("image",),
        group_block_tables=[[7, 8]],
        stage_output_reads=(9,),
        input_from_previous=False,
        draft_token_ids=(11, 12),
    )
    nxt = ScheduledRequest(**given).next_decode(4, [5, 6], False, 3, [[7, 10]])  # type: ignore[arg-type]
    changed = dict(token_ids=[0], start=4, block_table=[5, 6], sample=True, block_eos=False)
    changed.update(group_block_tables=[[7, 10]])
    changed.update(want_hidden_states=False, prompt_logprobs_from=3, prompt_hidden_from=None, mm_inputs=())
    changed.update(stage_output_reads=(), input_from_previous=True, draft_token_ids=())
    expected = {**given, **changed}
    assert {f.name for f in fields(ScheduledRequest)} == set(expected)
    for name, value in expected.items():
        assert getattr(nxt, name) == value, name
    assert nxt.prompt_token_ids is prompt and nxt.output_token_ids is output  # the request's own lists
    # with return_hidden_states each decode keeps its position's hidden state
    given.update(sampling_params=SamplingParams(temperature=0.5, return_hidden_states=True))
    nxt = ScheduledRequest(**given).next_decode(4, [5, 6], False, 3, [[7, 10]])  # type: ignore[arg-type]
    assert (nxt.want_hidden_states, nxt.prompt_hidden_from) == (True, 4)
    given.update(prompt_hidden_from=None)  # a sequence of n > 1 other than the first keeps none
    nxt = ScheduledRequest(**given).next_decode(4, [5, 6], False, 3, [[7, 10]])  # type: ignore[arg-type]
    assert (nxt.want_hidden_states, nxt.prompt_hidden_from) == (False, None)


def test_steps_scheduled_ahead_equal_the_full_build():
    """schedule_ahead carries each decode over from the step in flight (ScheduledRequest.next_decode),
    re-reading a block table only when a block was added: every field equals what the full build
    (Scheduler._scheduled) gives, across block boundaries, min_tokens and an arrival."""
    from dataclasses import fields

    s = Scheduler(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    reqs = [req("a", 5), req("b", 7, min_tokens=4), req("c", 3, max_tokens=6)]
    for r in reqs[:2]:
        s.add_request(r)
    step = s.schedule()
    for n in range(14):
        if n == 3:
            s.add_request(reqs[2])
        ahead = s.schedule_ahead(step, max_model_len=64)
        assert ahead is not None, n
        for sr in ahead.scheduled:
            if not sr.input_from_previous:  # the arrival, built in full
                continue
            full = s._scheduled(s.requests[sr.req_id], 0)
            full.token_ids, full.start, full.sample, full.input_from_previous = [0], sr.start, True, True
            full.block_eos = s.requests[sr.req_id].num_output_tokens + 1 < sr.sampling_params.min_tokens
            for f in fields(sr):
                assert getattr(sr, f.name) == getattr(full, f.name), (n, sr.req_id, f.name)
        ids = [sr.req_id for sr in step.scheduled if sr.sample]
        sampled, _ = s.update_from_output(step, ModelRunnerOutput(req_ids=ids, sampled_token_ids=[10 + n] * len(ids)))
        for r in sampled:  # the engine's output processor ends a request at max_tokens
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                s.finish_request(r, RequestStatus.FINISHED_LENGTH)
        step = ahead
    held = {r.request_id: len(r.all_token_ids) for r in s.running}
    assert all(-(-(held[sr.req_id] + 1) // 4) == len(sr.block_table) for sr in step.scheduled)


def test_prompts_in_chunks_go_on_ahead_as_schedule_would_split_them():
    """A prompt longer than the token budget goes on with its next chunk ahead of its tokens: step
    by step the same requests, starts, chunk sizes and samples as the in-order scheduler gives
    (decodes first in the running order, then the chunk, then an arrival), and each chunk's fields
    equal the full build's once the step in flight is booked."""
    from dataclasses import fields

    def booked(s: Scheduler, step, n: int) -> None:
        ids = [sr.req_id for sr in step.scheduled if sr.sample]
        sampled, _ = s.update_from_output(step, ModelRunnerOutput(req_ids=ids, sampled_token_ids=[10 + n] * len(ids)))
        for r in sampled:
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                s.finish_request(r, RequestStatus.FINISHED_LENGTH)

    def shape(step) -> list[tuple[str, int, int, bool]]:
        return [(sr.req_id, sr.start, len(sr.token_ids), sr.sample) for sr in step.scheduled]

    def requests() -> list[Request]:
        return [req("a", 3, max_tokens=12), req("b", 23, max_tokens=4), req("c", 9, max_tokens=3)]

    ahead_s, in_order = (Scheduler(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=6) for _ in "ab")
    for s in (ahead_s, in_order):
        for r in requests()[:2]:
            s.add_request(r)
    step = ahead_s.schedule()
    chunks = 0
    for n in range(30):
        want = in_order.schedule()
        assert shape(step) == shape(want), n
        booked(in_order, want, n)
        if n == 2:
            for s in (ahead_s, in_order):
                s.add_request(requests()[2])
        if not ahead_s.running and not ahead_s.waiting:
            break
        ahead = ahead_s.schedule_ahead(step, max_model_len=64)
        booked(ahead_s, step, n)
        if ahead is None:  # only once every request has ended
            assert not ahead_s.running, n
            break
        for sr in ahead.scheduled:
            if sr.input_from_previous or sr.start == 0:
                continue
            chunks += 1  # a chunk going on: built now, its step in flight booked, it is the full build's
            full = ahead_s._scheduled(ahead_s.requests[sr.req_id], len(sr.token_ids))
            for f in fields(sr):
                assert getattr(sr, f.name) == getattr(full, f.name), (n, sr.req_id, f.name)
        step = ahead
    assert chunks >= 4
    assert not ahead_s.running and not in_order.running


def test_a_booked_step_makes_readable_the_stage_rows_of_the_blocks_it_completed():
    """The stage-output cache's rows are written when a step is booked; then the blocks the step
    completed become readable - a block completed before its last token was known is entered in
    the cache then - but not those of a request preempted while the step ran (its blocks may be
    another's by then: that one's rows come at its own booking)."""
    spec = BlockTensorSpec(spec_name(HIDDEN_STATES, torch.float32), (4, 2), torch.float32, 0, "cpu", lazy=True)
    tensors = BlockTensors([spec])
    tensors.allocate(7, "cpu")
    s = Scheduler(num_blocks=7, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, stage_output_tensors=tensors)
    stage = s.stage_outputs
    assert stage is not None
    kv = s.kv_cache_manager
    reqs = [req("a", 7, max_tokens=2), req("b", 7), req("c", 7)]
    for r in reqs:
        s.add_request(r)
    step = s.schedule()  # 2 blocks each, the first full
    assert not any(stage.is_valid(b) for b in range(7))  # nothing booked yet
    ahead = s.schedule_ahead(step, max_model_len=64)  # each completes its second block with the token in flight
    assert ahead is not None
    s.update_from_output(step, ModelRunnerOutput(req_ids=["a", "b", "c"], sampled_token_ids=[1, 2, 3]))
    tables = {r.request_id: kv.get_block_ids(r.request_id) for r in reqs}
    assert all(stage.is_valid(t[0]) and not stage.is_valid(t[1]) for t in tables.values())
    # a's last token is in flight: left out; b needs a third block, 1 is free: c (newest) is preempted
    late = s.schedule_ahead(ahead, max_model_len=64)
    assert late is not None and late.preempted_req_ids == ["c"] and [sr.req_id for sr in late.scheduled] == ["b"]
    a_last = kv.block_pool.blocks[tables["a"][1]]
    assert a_last.uid == 0  # its last token came after the step was scheduled: not entered yet
    # c's freed blocks go to another request, and one is entered in the cache before the booking
    other = Request("e", [5, 6, 7, 8, 9])
    assert kv.allocate_slots(other, 5) is not None
    taken = kv.get_block_ids("e")
    assert set(taken) & set(tables["c"]) and kv.block_pool.blocks[taken[0]].uid != 0
    s.update_from_output(ahead, ModelRunnerOutput(req_ids=["a", "b", "c"], sampled_token_ids=[4, 5, 6]))
    assert a_last.uid != 0 and stage.is_valid(a_last.block_id)  # entered in the cache at the booking
    assert stage.is_valid(tables["b"][1])
    assert not any(stage.is_valid(b) for b in tables["c"]) and not stage.is_valid(taken[0])


def test_blocks_running_out_ahead_preempt_the_newest_which_keeps_its_token_in_flight():
    """schedule_ahead, out of blocks, preempts the newest request going on (the priority policy:
    the one of largest (priority, arrival)) instead of putting the step in order: its blocks are
    freed at once, the step in flight still books its token but no computed tokens (it recomputes
    what no cache hit gives back), nothing waiting is admitted behind the preemption, and it comes back once
    blocks are free."""
    for policy, victim, queue in (("fcfs", "c", ["c", "d"]), ("priority", "a", ["d", "a"])):
        s = Scheduler(num_blocks=7, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, policy=policy)
        reqs = [req("a", 8), req("b", 8), req("c", 8)]
        reqs[0].priority = 1  # served last under the priority policy
        for r in reqs:
            s.add_request(r)
        step = s.schedule()  # 2 blocks each: 1 left
        assert sorted(sr.req_id for sr in step.scheduled) == ["a", "b", "c"]
        late = req("d", 3)
        s.add_request(late)
        ahead = s.schedule_ahead(step, max_model_len=64)  # each needs a third block: one is preempted
        assert ahead is not None and ahead.preempted_req_ids == [victim]
        assert victim not in {sr.req_id for sr in ahead.scheduled}
        assert [r.request_id for r in s.waiting] == queue  # none admitted behind the preemption
        victim_req = s.requests[victim]
        assert victim_req.status is RequestStatus.PREEMPTED and s.num_preemptions == 1
        assert s.kv_cache_manager.num_blocks_held(victim) == 0
        s.update_from_output(step, ModelRunnerOutput(req_ids=["a", "b", "c"], sampled_token_ids=[7, 8, 9]))
        assert victim_req.output_token_ids == [{"a": 7, "b": 8, "c": 9}[victim]]
        assert victim_req.num_computed_tokens == 0 and not s._preempted_in_flight
        assert all(r.num_computed_tokens == 8 for r in reqs if r is not victim_req)
        s.update_from_output(
            ahead, ModelRunnerOutput(req_ids=[sr.req_id for sr in ahead.scheduled], sampled_token_ids=[1, 2])
        )
        for r in list(s.running):
            s.finish_request(r, RequestStatus.FINISHED_LENGTH)
        back = s.schedule()  # it recomputes what no cache hit gives back, up to the token booked late
        again = next(sr for sr in back.scheduled if sr.req_id == victim)
        assert again.start + len(again.token_ids) == 9 and again.token_ids[-1] == victim_req.output_token_ids[0]
        for r in list(s.requests.values()):
            s.finish_request(r, RequestStatus.FINISHED_ABORTED)
        assert s.kv_cache_manager.num_free_blocks == 7
