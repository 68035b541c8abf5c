"""The pinned prefixes written down, so that a restart pins them again (`pinned_prefixes_file`).

The file lists each pin as the engine was asked for it - token ids, tenant (cache salt), adapter -
for the model it was pinned on; it is rewritten (atomically) after every pin and unpin, so it
always says what is pinned now. At start the engine computes each listed prefix once more, which
reads its blocks from a KV tier where one holds them (a disk or Redis tier outlives the process),
and pins it again; a prefix the new engine cannot pin (past the pin bound, an adapter that will
not load, tokens outside the vocabulary) is named in a warning and left out of the rewritten file.
A file of another model is refused at start, never written over.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from ..lora.request import LoRARequest

FORMAT = 1


@dataclass(frozen=True)
class PinRecord:
    token_ids: tuple[int, ...]
    cache_salt: str | None
    lora: LoRARequest | None  # name, id and folder: enough to load the adapter again

    def to_json(self) -> dict[str, Any]:
        lora = self.lora
        return {
            "token_ids": list(self.token_ids),
            "cache_salt": self.cache_salt,
            "lora": None if lora is None else {"name": lora.lora_name, "id": lora.lora_int_id, "path": lora.lora_path},
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PinRecord:
        ids = d["token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("token_ids must be a list of integers")
        salt = d.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ValueError("cache_salt must be a string or null")
        lora = d.get("lora")
        return cls(
            tuple(ids),
            salt,
            None if lora is None else LoRARequest(str(lora["name"]), int(lora["id"]), str(lora["path"])),
        )


class PinManifest:
    """One file of pins for one model (`model_id`: pins of another model's file are not restored)."""

    def __init__(self, path: str, model_id: str) -> None:
        self.path = path
        self.model_id = model_id

    def read(self) -> tuple[list[PinRecord], list[str]]:
        """The pins the file lists, and a reason for each entry it cannot use (an absent file:
        none of either). ValueError for a file that is not a pin file of this model: writing over
        it would lose what it holds."""
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return [], []
        except (OSError, ValueError) as e:
            raise ValueError(f"pinned_prefixes_file {self.path} cannot be read as a pin file: {e}") from e
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("pins"), list):
            raise ValueError(f"pinned_prefixes_file {self.path} is not a pin file of format {FORMAT}")
        if data.get("model") != self.model_id:
            raise ValueError(
                f"pinned_prefixes_file {self.path} lists pins of model {data.get('model')!r}, not of "
                f"{self.model_id!r}: give this model a file of its own"
            )
        records, problems = [], []
        for i, entry in enumerate(data["pins"]):
            try:
                records.append(PinRecord.from_json(entry))
            except (KeyError, TypeError, ValueError) as e:
                problems.append(f"entry {i} of {self.path}: {e}")
        return records, problems

    def write(self, records: list[PinRecord]) -> None:
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, exist_ok=True)
        data = {"format": FORMAT, "model": self.model_id, "pins": [r.to_json() for r in records]}
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".pins-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f)
            os.replace(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise
