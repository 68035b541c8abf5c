"""`LoRARequest`: which adapter a request runs with, as vLLM names it (`vllm.lora.request`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, integer id and PEFT folder (`adapter_config.json` +
    `adapter_model.safetensors`), as vLLM's.

    `weights_digest` is not the user's to set: the engine fills it in when it loads the folder (a
    sha256 over the adapter's files), and the prefix cache keys blocks by name, path and digest, so
    new weights under an old name never hit the old adapter's KV."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
    weights_digest: str = ""

    @property
    def name(self) -> str:  # vLLM's alias
        return self.lora_name

    @property
    def path(self) -> str:  # vLLM's alias
        return self.lora_path
