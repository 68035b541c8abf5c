"""The package's import graph: no circles between modules, and no import from a lower layer to a
higher one (docs/design.md, "Layers").

Every module of prefixkv/ is parsed with `ast` (nothing is imported). An edge A -> B is any
`import` or `from ... import` in A that names B: at module level, inside a function (a deferred
import is still a dependency, only a later one), and under `if TYPE_CHECKING:` (a type the
module's signatures name is part of what it means; a circle through it is a circle the reader
and mypy follow, even if the interpreter never runs it). `from pkg import name` is an edge to
`pkg.name` when that is a module, else to `pkg`. Importing a module of another package also runs
that package's `__init__.py`, so it is an edge to the package too; a module's own packages are
already running and are not.

The layers, bottom to top (a module may import its own layer and the layers below):

1. foundation      cache/ (block identity, pool, eviction; imports nothing else of prefixkv),
                   outputs.py (RequestOutput and friends), progress.py (start-up stages), sizes.py (byte sizes),
                   lazy_exports.py (a package's names imported on first use), huge_pages.py (large
                   CPU tensors on 2 MiB pages: the K/V caches, the weights' layouts)
2. model           model/: configs, tokenizer, loader, decoders, kernels, and model/llava/
                   (the vision-language family's config, encoder, preprocessing and loader)
3. memory          memory/: the per-block tensors and their one budget
4. features        constraints/, lora/, multimodal/, stage_outputs/, kv_events/, tiers/, router/,
                   speculative/, reasoning.py:
                   each plugs into the engine through types it defines itself
5. requests        sampling_params.py, request.py, engine_args.py, config.py, inputs.py: what the
                   user asks and how the engine is configured, built from the features' types
6. engine          engine/: admission, scheduler, model runner
7. API             llm.py, the package root (its lazy `LLM` / `LLMEngine`), server/, replicas/,
                   pipeline/ (stages of `LLM`s), replay/ (the cache without the model)
8. entry points    cli.py, demo.py

A type that two layers share lives in the lower one (`multimodal/item.py`'s `MultiModalItem`,
which `request.py` holds; `memory/block_tensors.py`, which `stage_outputs/` registers into).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "prefixkv"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("cache", "outputs", "progress", "sizes", "lazy_exports", "huge_pages")),
    ("model", ("model",)),
    ("memory", ("memory",)),
    (
        "features",
        (
            "constraints",
            "lora",
            "multimodal",
            "stage_outputs",
            "kv_events",
            "tiers",
            "router",
            "speculative",
            "reasoning",
            "harmony",
        ),
    ),
    ("requests", ("sampling_params", "request", "engine_args", "config", "inputs")),
    ("engine", ("engine",)),
    ("API", ("", "llm", "server", "replicas", "pipeline", "replay")),  # "": the package root
    ("entry points", ("cli", "demo")),
]

# Edges that other pieces of the same change remove; each entry goes when its fix is merged, and
# an entry that matches no edge any more fails `test_the_allowlist_names_only_existing_edges`.
ALLOWED: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int

    def __str__(self) -> str:
        path = _modules()[self.src].relative_to(ROOT)
        return f"{self.src} -> {self.dst}  ({path}:{self.line})"


_MODULES: dict[str, Path] = {}


def _modules() -> dict[str, Path]:
    if not _MODULES:
        for path in sorted((ROOT / PACKAGE).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            _MODULES[".".join(parts)] = path
    return _MODULES


def _is_package(module: str) -> bool:
    return _modules()[module].name == "__init__.py"


def _known(name: str) -> str | None:
    """The longest prefix of a dotted name that is one of our modules."""
    modules = _modules()
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, with_allowed: bool = True) -> list[Edge]:
    """The module's edges; without the ALLOWED ones (and the package edges their imports imply)
    when `with_allowed` is False."""
    tree = ast.parse(_modules()[module].read_text(encoding="utf-8"))
    package = module if _is_package(module) else module.rpartition(".")[0]
    targets: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                sub = f"{origin}.{alias.name}"
                targets.append((sub if sub in _modules() else origin, node.lineno))
    edges: dict[tuple[str, int], None] = {}
    for name, line in targets:
        if name != PACKAGE and not name.startswith(PACKAGE + "."):
            continue
        dst = _known(name)
        if dst is None or (with_allowed is False and (module, dst) in ALLOWED):
            continue
        # the packages above `dst` that `module` is not inside run their __init__ first
        parts = dst.split(".")
        for i in range(2, len(parts) + 1):
            target = ".".join(parts[:i])
            if target != module and not module.startswith(target + "."):
                edges[(target, line)] = None
    return [Edge(module, dst, line) for dst, line in edges]


def _graph() -> dict[str, list[Edge]]:
    return {m: _imports(m, with_allowed=False) for m in _modules()}


def _layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for rank, (_, units) in enumerate(LAYERS):
        if top in units:
            return rank
    raise AssertionError(f"{module} belongs to no layer: add {top!r} to LAYERS in {Path(__file__).name}")


def _cycles(graph: dict[str, list[Edge]]) -> list[tuple[set[str], list[Edge]]]:
    """Each strongly connected component of more than one module, with one cycle through it
    (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for e in graph[v]:
            if e.dst not in index:
                visit(e.dst)
                low[v] = min(low[v], low[e.dst])
            elif e.dst in on_stack:
                low[v] = min(low[v], index[e.dst])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [(c, _cycle_in(graph, c)) for c in components]


def _cycle_in(graph: dict[str, list[Edge]], component: set[str]) -> list[Edge]:
    """The shortest way back to the component's first module (breadth first)."""
    start = min(component)
    came: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for e in sorted(graph[v], key=lambda e: e.dst):
                if e.dst not in component or e.dst in came:
                    continue
                came[e.dst] = e
                if e.dst == start:
                    path = [e]
                    while path[0].src != start:
                        path.insert(0, came[path[0].src])
                    return path
                nxt.append(e.dst)
        frontier = nxt
    raise AssertionError(f"no cycle found in {sorted(component)}")


def test_every_module_belongs_to_a_layer():
    for module in _modules():
        _layer_of(module)


def test_no_import_circles():
    cycles = _cycles(_graph())
    report = "\n\n".join(
        f"  {', '.join(sorted(members))} import each other; one way round:\n" + "\n".join(f"    {e}" for e in cycle)
        for members, cycle in cycles
    )
    assert not cycles, f"{len(cycles)} import circle(s) between modules:\n\n{report}"


def test_no_import_from_a_lower_layer_to_a_higher_one():
    upward = [e for edges in _graph().values() for e in edges if _layer_of(e.src) < _layer_of(e.dst)]
    report = "\n".join(f"  [{LAYERS[_layer_of(e.src)][0]} -> {LAYERS[_layer_of(e.dst)][0]}]  {e}" for e in upward)
    assert not upward, f"{len(upward)} upward import(s) (layers: docs/design.md, 'Layers'):\n{report}"


def test_the_allowlist_names_only_existing_edges():
    present = {(e.src, e.dst) for m in _modules() for e in _imports(m, with_allowed=True)}
    gone = [f"  {src} -> {dst}  ({why})" for (src, dst), why in ALLOWED.items() if (src, dst) not in present]
    assert not gone, "allowed edges that no longer exist (remove them from ALLOWED):\n" + "\n".join(gone)
