"""A tiny Qwen 3 checkpoint, built with transformers' own classes, that thinks on cue: its weights
make it a bigram model that, greedy, writes a fixed script after a prompt's last token. With
`<think>`, `</think>`, `<tool_call>` as tokens of its vocabulary (Qwen 3's markers), it is what a
reasoning parser reads, end to end, with outputs known in advance.

How: one layer whose attention and MLP write nothing (o_proj, down_proj zero), so the last hidden
state is the token's own embedding; the scripted tokens' embeddings are orthonormal (scaled), and
lm_head's row for token b is the embedding of the token a with SCRIPT[a] = b. Token a then scores
sqrt(hidden) for its successor and 0 for every other token. Tokens outside the script score 0
everywhere (greedy takes the lowest id: a grammar's forced text comes out one way).
"""

from __future__ import annotations

import json
from pathlib import Path

# added tokens, not special (as Qwen 3's); MiniMax-M2's call markers too
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<minimax:tool_call>", "</minimax:tool_call>"]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]  # + GLM's turns
# A prompt's template ends with "\n" after "assistant": the reply is "<think>hm</think>OK", then EOS.
# After "?" (a continued reply that ends with it): "<tool_call>" at once, without "</think>".
SCRIPT = [("\n", "<think>"), ("<think>", "h"), ("h", "m"), ("m", "</think>"), ("</think>", "O"), ("O", "K")]
SCRIPT += [("K", "<|im_end|>"), ("?", "<tool_call>"), ("<tool_call>", "<|im_end|>")]

TEMPLATE = (  # Qwen 3's shape, short: tools, earlier reasoning and tool calls rendered
    "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{% if not (loop.last and m.role == 'assistant') %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


def write_scripted_thinker(folder: Path, special_markers: bool = False) -> Path:
    """The checkpoint (config.json, model.safetensors, tokenizer.json, tokenizer_config.json) in
    `folder`; returns it. `special_markers`: the markers are special tokens (as some thinking
    models' are), which decoding skips by default."""
    return write_scripted_model(folder, MARKERS, SPECIALS, SCRIPT, TEMPLATE, ["<|im_end|>"], special_markers)


def write_scripted_model(
    folder: Path,
    markers: list[str],
    specials: list[str],
    script: list[tuple[str, str]],
    template: str,
    eos: list[str],
    special_markers: bool = False,
) -> Path:
    """A bigram checkpoint that writes `script` (pairs: a token, the token greedy decoding writes
    after it), its vocabulary the 256 bytes, `markers` (added tokens, special where
    `special_markers`) and `specials` (special tokens); `eos` end a reply (the first is the
    tokenizer's)."""
    import torch
    import transformers as tf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from prefixkv.model.tokenizer import _bytes_to_unicode

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {ch: i for i, ch in enumerate(sorted(_bytes_to_unicode().values()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(m, special=special_markers, normalized=False) for m in markers])
    tok.add_special_tokens(specials)
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": eos[0], "pad_token": eos[0], "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))

    def tid(text: str) -> int:
        i = tok.token_to_id(text)
        if i is None:  # a byte: its character in the byte-level table
            i = tok.token_to_id("".join(_bytes_to_unicode()[b] for b in text.encode()))
        assert i is not None, text
        return i

    n_vocab, hidden = tok.get_vocab_size(), 64
    cfg = tf.Qwen3Config(
        vocab_size=n_vocab,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=[tid(e) for e in eos] if len(eos) > 1 else tid(eos[0]),
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = tf.Qwen3ForCausalLM(cfg).eval()
    scripted = sorted({tid(a) for a, _ in script} | {tid(b) for _, b in script})
    assert len(scripted) <= hidden
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")) or name == "lm_head.weight":
                p.zero_()
            else:
                p.copy_(0.02 * torch.randn_like(p))
        emb = model.model.embed_tokens.weight
        basis = torch.eye(hidden)
        for k, t in enumerate(scripted):
            emb[t] = basis[k] * 0.5
        for a, b in script:
            model.lm_head.weight[tid(b)] += emb[tid(a)] * 10.0
    model.save_pretrained(folder, safe_serialization=True)
    return folder
