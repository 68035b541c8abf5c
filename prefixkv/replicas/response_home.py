"""Where a Responses API request goes under --replicas. Each replica keeps the responses it made
(server/responses_store.py, in memory) and names itself in their ids (resp_r<index>_...), so a
request chaining to one (`previous_response_id`) or reading one (GET / DELETE /v1/responses/{id})
goes to that replica; a new conversation goes wherever the router's policy sends it."""

from __future__ import annotations

import json
import re

RESPONSES = "/v1/responses"
_ID = re.compile(r"^resp_r(\d+)_[0-9a-f]+$")


def response_id_prefix(replica_index: int) -> str:
    return f"resp_r{replica_index}"


def replica_of(response_id: object) -> int | None:
    """The index of the replica that made a response, from its id (None: not such an id)."""
    m = _ID.match(response_id) if isinstance(response_id, str) else None
    return int(m.group(1)) if m else None


def response_home(method: str, path: str, body: bytes) -> int | None:
    """The replica a Responses request must reach, or None when any replica may take it."""
    if path == RESPONSES and method == "POST":
        try:
            parsed = json.loads(body)
        except ValueError:
            return None
        return replica_of(parsed.get("previous_response_id")) if isinstance(parsed, dict) else None
    if path.startswith(RESPONSES + "/"):
        return replica_of(path[len(RESPONSES) + 1 :].split("/")[0])
    return None
