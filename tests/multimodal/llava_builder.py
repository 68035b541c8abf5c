"""Tiny random LLaVA 1.5 checkpoints written by transformers itself (LlavaForConditionalGeneration:
a CLIP vision tower, the MLP projector, a Llama decoder), saved as an HF folder with a byte-level
tokenizer that has an `<image>` token, a chat template that renders image parts, and a CLIP
preprocessor config. No vision weights can be downloaded here; transformers is the oracle.

Also used by bench/multimodal.py (with larger sizes)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

IMAGE_TOKEN = "<image>"
BOS, EOS = 256, 257
IMAGE_TOKEN_ID = 258

# llava-hf's template, without transformers' {% generation %} tags: images first, then the text
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}"
    "{% endif %}{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}"
    "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from prefixkv.model.tokenizer import _bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(sorted(_bytes_to_unicode().values()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", IMAGE_TOKEN])
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


def build_llava(
    folder: Path,
    *,
    image_size: int = 30,
    patch_size: int = 6,
    vision_hidden: int = 32,
    vision_layers: int = 3,
    text_hidden: int = 64,
    text_layers: int = 2,
    text_intermediate: int = 96,
    vision_feature_layer: int | list[int] = -2,
    strategy: str = "default",
    max_position_embeddings: int = 512,
    seed: int = 0,
    randomize: bool = True,
    text_model: str = "llama",
):
    """Write the checkpoint to `folder` and return transformers' model (eval mode, float32)."""
    import transformers as tf
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vc = tf.CLIPVisionConfig(
        hidden_size=vision_hidden,
        intermediate_size=2 * vision_hidden,
        num_hidden_layers=vision_layers,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=patch_size,
        hidden_act="quick_gelu",
        projection_dim=16,
    )
    text_config = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig}[text_model]
    tc = text_config(
        vocab_size=260,
        hidden_size=text_hidden,
        intermediate_size=text_intermediate,
        num_hidden_layers=text_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )
    n_tokens = (image_size // patch_size) ** 2 + (1 if strategy == "full" else 0)
    cfg = tf.LlavaConfig(
        vision_config=vc,
        text_config=tc,
        image_token_index=IMAGE_TOKEN_ID,
        vision_feature_layer=vision_feature_layer,
        vision_feature_select_strategy=strategy,
        projector_hidden_act="gelu",
        image_seq_length=n_tokens,
    )
    torch.manual_seed(seed)
    model = tf.LlavaForConditionalGeneration(cfg).eval()
    if randomize:
        with torch.no_grad():  # larger than the init, so images and prompts change greedy tokens
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                elif "embedding" in name:
                    p.copy_(0.5 * torch.randn_like(p))
                else:
                    p.copy_(0.15 * torch.randn_like(p))
    model.save_pretrained(folder)
    write_tokenizer(folder)
    proc = CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    proc.save_pretrained(folder)
    return model


@torch.inference_mode()
def hf_llava_greedy(model, input_ids: list[int], pixel_values: torch.Tensor | None, max_new_tokens: int) -> list[int]:
    """transformers' greedy decoding of an already expanded prompt (one <image> per image token)."""
    kwargs = {} if pixel_values is None else {"pixel_values": pixel_values}
    out = model(input_ids=torch.tensor([input_ids]), use_cache=True, **kwargs)
    past, tokens = out.past_key_values, []
    for _ in range(max_new_tokens):
        tok = int(out.logits[0, -1].argmax())
        tokens.append(tok)
        out = model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return tokens
