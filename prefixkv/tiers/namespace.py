"""The cache identity of an engine's KV blocks outside its process: the namespace of tier keys.

Two engines may share a block only if the block's KV bytes would be the same. The namespace is a
digest of everything that decides those bytes:

- the weights: a digest of every weight (not a file name), packed for the CPU's kernels or not,
  of the decoder and, for a vision-language model, of the vision tower and projector;
- the model's configuration, whole: every field of its config dataclass (and of the multimodal
  config and image preprocessing), canonically serialized. Some of what the forward depends on
  is in no tensor of the state dict - the rotary cos/sin are computed from `rope_theta` /
  `rope_scaling`, the norms use `rms_norm_eps` - and hashing every field (rather than a list of
  the ones known to matter) covers fields added later by default; a field that changes nothing
  only costs sharing;
- the compute dtype, the KV dtype and layout, the block size, the device kind;
- the tokenizer (its full serialization: vocabulary, merges, added tokens, normalization, and
  its BOS/EOS handling), so that two engines whose tokenizers turn a text into other ids keep
  apart;
- the content-hash function and seed (through the chain's root hash, NONE_HASH);
- with a tier secret (`kv_tier_secret`), a keyed tag derived from it (never the secret itself),
  so engines with other secrets - or none - keep to their own keys instead of overwriting each
  other's values with ones the others refuse.

Everything goes into one digest that prefixes every key, so a store shared by several engines
or models never even looks in another's keys; the value check (value.py) catches the rest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from typing import Any

import cbor2
import torch
import xxhash

from ..model.layers import tensor_digest

# bump when the value layout or what the namespace covers changes; 2: the model config, dtype,
# tokenizer and vision weights joined the namespace, packed CPU weights count
NAMESPACE_VERSION = 2


def weights_digest(*models: torch.nn.Module | None) -> str:
    """xxh3-128 over every weight - name, dtype, shape, bytes - of each model given (None skipped:
    a text-only engine has no vision encoder), in name order.

    Not `state_dict()` alone: on a CPU the engine lays the matmul weights out for its kernels
    (LlamaModel.pack_for_cpu) outside the modules' parameters, so the state dict then holds the
    embeddings and norms only; a packed layer carries the digests of the weights it was made from
    (`source_digests`, under its original name, `source_name`), which stand in for them. The
    digest is the same packed or not, and it changes with any weight."""
    h = xxhash.xxh3_128()
    for index, model in enumerate(models):
        if model is None:
            continue
        entries: dict[str, str] = {}
        with torch.no_grad():
            for path, module in model.named_modules():
                prefix = f"{path}." if path else ""
                skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
                for name, t in module.named_parameters(recurse=False):
                    entries[prefix + name] = tensor_digest(t)
                for name, t in module.named_buffers(recurse=False):
                    if name not in skip:
                        entries[prefix + name] = tensor_digest(t)
                packed = getattr(module, "source_digests", None)
                if packed:
                    source = getattr(module, "source_name", None)
                    source_prefix = f"{source}." if source else prefix
                    for name, digest in packed.items():
                        entries[source_prefix + name] = digest
        h.update(f"#{index}|".encode())  # the part it belongs to: a tensor cannot move between parts
        for name in sorted(entries):
            h.update(f"{name}|{entries[name]}|".encode())
    return h.hexdigest()


def _plain(value: Any) -> Any:
    """A config value as CBOR-able plain data: dataclasses (tagged with their class name) and
    mappings recursively, sequences as lists; anything else by its repr, so an unknown type still
    counts rather than failing or being skipped."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"__class__": type(value).__qualname__, **fields}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    return repr(value)


def config_digest(*configs: Any) -> str:
    """sha256 over a canonical CBOR of every field of the configs given (dataclasses, compared
    field by field: a float as its exact value, a dict whatever its key order)."""
    return hashlib.sha256(cbor2.dumps([_plain(c) for c in configs], canonical=True)).hexdigest()


def tokenizer_digest(tokenizer: Any) -> str:
    """sha256 of what turns text into ids: the HF tokenizer's full serialization and the special
    tokens added around a prompt."""
    h = hashlib.sha256()
    h.update(tokenizer.backend.to_str().encode())
    extra = [tokenizer.bos_token_id, tokenizer.add_bos_token, tokenizer.add_eos_token, sorted(tokenizer.eos_token_ids)]
    h.update(cbor2.dumps(extra, canonical=True))
    return h.hexdigest()


def secret_key_tag(secret: bytes) -> bytes:
    """A tag of the tier secret for the namespace: HMAC-SHA256 of a fixed label under the secret.
    It names the secret's key space without revealing the secret (keys are visible in the store)."""
    return hmac.new(secret, b"prefixkv kv-tier namespace", hashlib.sha256).digest()


def tier_namespace(
    *,
    weights: str,
    config: str,
    dtype: str,
    tokenizer: str,
    kv_layout: list[tuple[tuple[int, ...], str]],
    block_size: int,
    device_type: str,
    root_hash: bytes,
    secret_tag: bytes | None = None,
) -> bytes:
    """16 bytes naming the engine's cache identity. `weights`, `config`, `tokenizer`: the digests
    above; `root_hash` is the chain's NONE_HASH (it depends on the hash algorithm and its seed);
    `secret_tag` the tier secret's tag (None without a secret)."""
    ident = cbor2.dumps(
        [
            NAMESPACE_VERSION,
            weights,
            config,
            dtype,
            tokenizer,
            [[list(s), d] for s, d in kv_layout],
            block_size,
            device_type,
            root_hash,
            secret_tag,
        ],
        canonical=True,
    )
    return hashlib.sha256(ident).digest()[:16]
