"""Merge the replicas' Prometheus texts into one exposition, every sample labelled replica="i".

The text format wants each metric family's samples together under one HELP / TYPE, so samples
are grouped by family (the last `# TYPE` seen in a replica's text), families in first-seen order.
"""

from __future__ import annotations

from collections.abc import Iterable


def _with_label(sample: str, label: str) -> str:
    brace = sample.find("{")
    space = sample.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        rest = sample[brace + 1 :]
        return f"{sample[: brace + 1]}{label}{'' if rest.startswith('}') else ','}{rest}"
    if space == -1:
        return sample
    return f"{sample[:space]}{{{label}}}{sample[space:]}"


def merge_expositions(texts: Iterable[tuple[str, str]]) -> str:
    """(replica id, Prometheus text) pairs -> one text."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in texts:
        label = f'replica="{replica}"'
        family = ""
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    headers.setdefault(family, [])
                    samples.setdefault(family, [])
                    if not any(h.split(None, 2)[1] == parts[1] for h in headers[family]):
                        headers[family].append(line)
                continue
            samples.setdefault(family, []).append(_with_label(line, label))
    out: list[str] = []
    for family, lines in samples.items():
        out += headers.get(family, [])
        out += lines
    return "\n".join(out) + "\n"
