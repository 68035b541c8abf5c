"""A sliding-window prefill computed window by window (model/attention.py `_Band`) equals the
masked attention of every query over the whole prompt, with grouped heads, at prompt lengths
around the chunk edges; and paged_attention takes that path for a long fresh prompt."""

import pytest
import torch
import torch.nn.functional as F

from prefixkv.model.attention import AttentionMetadata, _Band, paged_attention


def dense(q, k, v, window, scale):
    n = q.shape[0]
    pos = torch.arange(n)
    diff = pos[:, None] - pos[None, :]
    mask = (diff >= 0) & (diff < window)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("n, window", [(33, 16), (64, 16), (65, 16), (97, 32), (300, 7)])
def test_band_equals_the_masked_attention(n, window):
    torch.manual_seed(n)
    q, k, v = torch.randn(n, 4, 16), torch.randn(n, 2, 16), torch.randn(n, 2, 16)
    got = _Band(n, window, torch.device("cpu")).attend(q, k, v, 0.25, True)
    torch.testing.assert_close(got, dense(q, k, v, window, 0.25), atol=1e-5, rtol=1e-5)


def test_paged_attention_takes_the_band_for_a_long_fresh_prompt():
    n, window, bs = 100, 16, 16
    torch.manual_seed(0)
    q, k, v = torch.randn(n, 4, 16), torch.randn(n, 2, 16), torch.randn(n, 2, 16)
    blocks = -(-n // bs)
    cache = torch.zeros(2, blocks, bs, 2, 16)
    meta = AttentionMetadata(torch.arange(n), [0, n], [n], torch.arange(blocks)[None])
    out = paged_attention(q, k, v, cache, meta, scale=0.25, window=window)
    plan = meta.plan(bs, q.device, window, q.dtype)
    assert isinstance(plan.fresh[0][2], _Band)
    torch.testing.assert_close(out, dense(q, k, v, window, 0.25), atol=1e-5, rtol=1e-5)
