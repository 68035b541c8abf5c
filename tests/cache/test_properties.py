"""Invariants under random sequences of allocate / append / free / reset (hypothesis)."""

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixkv.cache import KVCacheManager
from prefixkv.request import Request

VOCAB = st.integers(min_value=0, max_value=2)  # tiny vocabulary: prefixes repeat often


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(4, 16),
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.booleans(),
        algo=st.sampled_from(["sha256_cbor", "degenerate"]),
    )
    def setup(self, num_blocks, block_size, caching, algo):
        hash_algo = (lambda obj: b"x") if algo == "degenerate" else algo
        self.mgr = KVCacheManager(
            num_blocks=num_blocks,
            block_size=block_size,
            enable_caching=caching,
            hash_algo=hash_algo,
            enable_kv_cache_events=True,
        )
        self.live: dict[str, Request] = {}
        self.n = 0
        # ground truth: the token prefix each cached block stands for, kept outside the manager
        self.content: dict[int, tuple] = {}

    def _record_content(self, req):
        bs = self.mgr.block_size
        for i, block in enumerate(self.mgr.get_blocks(req.request_id)):
            if block.block_key is not None:
                self.content[block.block_id] = (tuple(req.all_token_ids[: (i + 1) * bs]),)

    @rule(prompt=st.lists(VOCAB, min_size=1, max_size=24))
    def add(self, prompt):
        req = Request(f"r{self.n}", prompt)
        self.n += 1
        hits, num_hit = self.mgr.get_computed_blocks(req)
        assert num_hit <= req.num_tokens - 1 and num_hit == len(hits) * self.mgr.block_size
        bs = self.mgr.block_size
        for i, block in enumerate(hits):  # no false hit: the block holds exactly this prefix
            assert self.content[block.block_id] == (tuple(prompt[: (i + 1) * bs]),)
        new = self.mgr.allocate_slots(req, req.num_tokens - num_hit, hits)
        if new is None:
            assert self.mgr.get_block_ids(req.request_id) == []
            return
        req.num_computed_tokens = req.num_tokens
        self.live[req.request_id] = req
        self._record_content(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=VOCAB)
    def append(self, data, token):
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        req.append_output_token_ids([token])
        if self.mgr.allocate_slots(req, 1) is None:
            self.mgr.free(req)  # preempted: a real scheduler would requeue it
            del self.live[req.request_id]
            return
        req.num_computed_tokens += 1
        self._record_content(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        req = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.mgr.free(req)

    @rule()
    def reset(self):
        ok = self.mgr.reset_prefix_cache()
        assert ok == (not self.live)
        if ok:
            self.content.clear()

    @invariant()
    def blocks_are_free_xor_held(self):
        pool = self.mgr.block_pool
        holders = Counter(b for r in self.live.values() for b in self.mgr.get_block_ids(r.request_id))
        free_ids = pool.eviction_policy.block_ids()
        assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
        free = set(free_ids)
        for block in pool.blocks:
            if block.block_id in free:
                assert block.ref_cnt == 0 and holders[block.block_id] == 0
            else:
                assert block.ref_cnt == holders[block.block_id] > 0
        assert len(free) + len(holders) == pool.num_blocks

    @invariant()
    def table_entries_match_their_blocks(self):
        pool = self.mgr.block_pool
        in_table = 0
        for key, blocks in pool.cached_blocks.items():
            assert blocks and pool.get_cached_block(key) is blocks[0]
            assert len({b.uid for b in blocks}) == 1
            for block in blocks:
                assert block.block_key == key
                in_table += 1
        assert in_table == sum(b.block_key is not None for b in pool.blocks)
        if not self.mgr.enable_caching:
            assert in_table == 0

    def teardown(self):
        for req in list(self.live.values()):
            self.mgr.free(req)
        assert self.mgr.num_free_blocks == self.mgr.num_blocks and self.mgr.usage == 0.0
        assert self.mgr._requests == {}


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
