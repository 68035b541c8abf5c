"""The embedded default model (SmolLM2-135M GGUF) through the paged path vs transformers."""

import pytest
import torch

from prefixkv.memory.block_tensors import allocate_kv_cache

from .model_helpers import run_logits

BS = 16
POOL = 64
ATOL = 1e-3


@pytest.fixture(scope="module")
def prompt_ids(default_lm):
    tok = default_lm.tokenizer
    return tok.apply_chat_template(
        [{"role": "user", "content": "Name three rivers in Europe and give the length of each in km, 1-2 sentences."}],
        tokenize=True,
    )


@pytest.fixture(scope="module")
def hf_logits(hf_ref_model, prompt_ids):
    with torch.no_grad():
        return hf_ref_model(torch.tensor([prompt_ids])).logits[0]


def _blocks(n, seed):
    g = torch.Generator().manual_seed(seed)
    nb = (n + BS - 1) // BS
    return torch.randperm(POOL, generator=g)[:nb].tolist()


def _close(a, b, atol=ATOL):
    diff = (a - b).abs().max().item()
    assert diff <= atol + 1e-4 * b.abs().max().item(), f"max abs diff {diff}"


def test_prompt_logits_match_transformers(default_lm, prompt_ids, hf_logits):
    model, cfg = default_lm.model, default_lm.config
    caches = allocate_kv_cache(cfg, POOL, BS)
    blocks = _blocks(len(prompt_ids), 1)
    assert blocks != sorted(blocks)  # really scattered
    logits, _ = run_logits(model, caches, [(prompt_ids, blocks, 0)], BS)
    assert logits.shape == hf_logits.shape
    _close(logits, hf_logits)
    assert torch.equal(logits.argmax(-1), hf_logits.argmax(-1))


@pytest.mark.parametrize("split", [16, 21, 45])
def test_two_chunks_equal_one_shot(default_lm, prompt_ids, hf_logits, split):
    model, cfg = default_lm.model, default_lm.config
    caches = allocate_kv_cache(cfg, POOL, BS)
    blocks = _blocks(len(prompt_ids), 2)
    first, _ = run_logits(model, caches, [(prompt_ids[:split], blocks, 0)], BS)
    second, _ = run_logits(model, caches, [(prompt_ids, blocks, split)], BS)
    both = torch.cat([first, second])
    _close(both, hf_logits)
    assert torch.equal(both.argmax(-1), hf_logits.argmax(-1))


def test_decode_steps_match_transformers_greedy(default_lm, hf_ref_model, prompt_ids):
    """Greedy decode through the paged decode path; every step's logits must equal
    transformers' logits for the same position of the final sequence."""
    model, cfg = default_lm.model, default_lm.config
    n_new = 8
    caches = allocate_kv_cache(cfg, POOL, BS)
    blocks = _blocks(len(prompt_ids) + n_new, 3)
    ids = list(prompt_ids)
    logits, _ = run_logits(model, caches, [(ids, blocks, 0)], BS)
    step_logits = [logits[-1]]
    for _ in range(n_new):
        ids.append(int(step_logits[-1].argmax()))
        logits, _ = run_logits(model, caches, [(ids, blocks, len(ids) - 1)], BS)
        step_logits.append(logits[-1])
    with torch.no_grad():
        ref = hf_ref_model(torch.tensor([ids])).logits[0, len(prompt_ids) - 1 :]
    ours = torch.stack(step_logits)
    _close(ours, ref)
    assert ours.argmax(-1)[:-1].tolist() == ids[len(prompt_ids) :]
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_mixed_batch_equals_each_alone(default_lm):
    """One step with: a fresh prefill, two decodes (different lengths), a chunked prefill
    after cached context, and a sequence reusing a block that the fresh prefill writes in
    this very step. Each row must equal the same sequence computed on its own."""
    model, cfg, tok = default_lm.model, default_lm.config, default_lm.tokenizer
    texts = [
        "The quick brown fox jumps over the lazy dog. " * 2,
        "Paris is the capital of France and",
        "In 1969, Apollo 11 landed on the Moon; the crew were",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    ]
    seqs = [tok.encode(t) for t in texts]
    a, b, c, d = seqs
    pool = list(torch.randperm(POOL, generator=torch.Generator().manual_seed(7)).tolist())

    def take(n):
        return [pool.pop() for _ in range((n + BS - 1) // BS)]

    # Reference: each sequence alone, one shot, fresh cache.
    def alone(ids):
        caches = allocate_kv_cache(cfg, POOL, BS)
        lg, _ = run_logits(model, caches, [(ids, take(len(ids)), 0)], BS)
        return lg

    ref = [alone(s) for s in seqs]
    # sequence E shares A's first block (same first 16 tokens), then its own tokens
    e = a[:BS] + tok.encode(" A different ending here.")
    ref_e = alone(e)

    caches = allocate_kv_cache(cfg, POOL, BS)
    blk = {k: take(len(s) + 1) for k, s in zip("abcd", seqs)}
    # earlier steps: b and c prefill all but their last token; d prefills a 10-token prefix
    run_logits(model, caches, [(b[:-1], blk["b"], 0), (c[:-1], blk["c"], 0)], BS)
    run_logits(model, caches, [(d[:10], blk["d"], 0)], BS)
    blk_e = [blk["a"][0]] + take(len(e) - BS)
    step = [(a, blk["a"], 0), (b, blk["b"], len(b) - 1), (c, blk["c"], len(c) - 1), (d, blk["d"], 10), (e, blk_e, BS)]
    logits, qsl = run_logits(model, caches, step, BS)
    _close(logits[qsl[0] : qsl[1]], ref[0], 1e-4)
    _close(logits[qsl[1] : qsl[2]], ref[1][-1:], 1e-4)
    _close(logits[qsl[2] : qsl[3]], ref[2][-1:], 1e-4)
    _close(logits[qsl[3] : qsl[4]], ref[3][10:], 1e-4)
    _close(logits[qsl[4] : qsl[5]], ref_e[BS:], 1e-4)


def test_batched_decode_equals_single(default_lm):
    """A pure decode batch (padded, one SDPA) equals each decode alone."""
    model, cfg, tok = default_lm.model, default_lm.config, default_lm.tokenizer
    seqs = [
        tok.encode(t)
        for t in ["Hello there, my name is", "One two three four five six seven eight nine ten", "Why is the sky blue?"]
    ]
    caches = allocate_kv_cache(cfg, POOL, BS)
    pool = torch.randperm(POOL, generator=torch.Generator().manual_seed(9)).tolist()
    blocks = [[pool.pop() for _ in range((len(s) + BS - 1) // BS)] for s in seqs]
    run_logits(model, caches, [(s[:-1], bl, 0) for s, bl in zip(seqs, blocks)], BS)
    batched, _ = run_logits(model, caches, [(s, bl, len(s) - 1) for s, bl in zip(seqs, blocks)], BS)
    for i, (s, bl) in enumerate(zip(seqs, blocks)):
        single, _ = run_logits(model, caches, [(s, bl, len(s) - 1)], BS)
        _close(batched[i : i + 1], single, 1e-4)


def test_shared_prefix_cascade_equals_each_alone(default_lm):
    """Sequences whose block tables share leading blocks (a cached system prompt) take the
    cascade path - the prefix attended once for all of them, merged by log-sum-exp - and must
    give the logits each gets alone. Covers decodes and a chunked prefill reading the prefix."""
    from prefixkv.model.attention import CASCADE_MIN_TOKENS

    m, cfg = default_lm.model, default_lm.config
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, cfg.vocab_size, (5 * BS,), generator=g).tolist()  # 80 shared tokens
    assert len(prefix) >= CASCADE_MIN_TOKENS
    tails = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (7, 21, 3, 12)]
    shared_blocks = [40, 3, 17, 9, 28]
    own = [[50, 51], [52, 53], [54], [55, 56]]

    def fill(caches):  # compute the shared prefix once, then each tail's context but its last token(s)
        run_logits(m, caches, [(prefix, shared_blocks, 0)], BS)
        for tail, blocks in zip(tails, own):
            run_logits(m, caches, [(prefix + tail[:-1], shared_blocks + blocks, len(prefix))], BS)

    # batch: three decodes and one 4-token chunk (the last sequence), all reading the shared prefix
    seqs = [(prefix + t, shared_blocks + b, len(prefix) + len(t) - 1) for t, b in zip(tails[:3], own[:3])]
    seqs.append((prefix + tails[3], shared_blocks + own[3], len(prefix) + len(tails[3]) - 4))
    caches = allocate_kv_cache(cfg, POOL, BS)
    fill(caches)
    batch_logits, qsl = run_logits(m, caches, seqs, BS)
    for i, seq in enumerate(seqs):
        alone = allocate_kv_cache(cfg, POOL, BS)
        fill(alone)
        logits, _ = run_logits(m, alone, [seq], BS)
        _close(batch_logits[qsl[i] : qsl[i + 1]], logits)
