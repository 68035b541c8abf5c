"""Requests whose text cannot be written back: a JSON body may carry lone UTF-16 surrogates
("\\ud800"), which Python parses into strings that UTF-8 cannot encode. A field echoed into the
response (request_id as the id, Responses' metadata) would then fail the response itself - a
stream mid-way, after its status line - so every string of a request is checked before any
work, and the first bad one is refused by name."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from .errors import APIError


def first_unencodable(value: Any, path: str = "") -> tuple[str, UnicodeEncodeError] | None:
    """The path of the first string under `value` (models, dicts, lists) that UTF-8 cannot
    encode, with the error; None when every string can be."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return path, e
        return None
    if isinstance(value, BaseModel):
        fields = dict(value.__dict__)
        fields.update(value.model_extra or {})
        items: Any = fields.items()
    elif isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and (found := first_unencodable(key, path)) is not None:
            return found
        name = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        if (found := first_unencodable(item, name)) is not None:
            return found
    return None


def refuse_unencodable(req: Any) -> None:
    """A 400 naming the first string of `req` that is not valid Unicode text."""
    found = first_unencodable(req)
    if found is not None:
        path, e = found
        param = path.split(".")[0].split("[")[0] or None
        raise APIError(
            f"{path or 'a field name'} is not valid Unicode text: {e.reason} at character {e.start}", 400, param=param
        )
