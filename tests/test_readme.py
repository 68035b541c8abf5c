"""The README's and docs' snippets run as written, from the repo root, on a fresh clone.

What runs and how (choices, so that the suite stays lean and never recurses):

* README ```python blocks: each runs whole in a subprocess with the repo's venv python, cwd = repo root.
* README ```bash blocks, line by line (comments stripped), with the venv's bin/ first on PATH:
  - `make test` is skipped: it would run this test again; `make demo` runs with the install stamp
    taken as up to date (`make -o .venv/.installed demo`), so a changed pyproject.toml does not
    reinstall the venv in the middle of the tests;
  - `prefixkv serve ...` is started as written except for the port (a free one instead of 8000),
    checked with GET /health and a real completion, then stopped;
  - every other command must finish on its own with exit status 0.
* docs/*.md (and the README again) ```bash blocks: every command that names a bench script or a
  prefixkv subcommand is checked cheaply - the script exists, and every --flag it is given is
  listed by its --help (every Python program's --help run in one process: tests/help_texts.py; the
  benchmarks themselves take minutes to hours: `make bench`). `make X` lines must name a Makefile
  target. pytest lines are skipped (recursion).
* docs/serving.md's OpenAI-client snippet runs against a server started with the flags it assumes
  (--api-key sk-local --served-model-name smol) on a free port.

Everything that loads the model is marked slow (run by `make test` and CI; `make test-fast`
deselects it).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT / ".venv" / "bin"
PY = str(BIN / "python") if (BIN / "python").exists() else sys.executable
DOCS = sorted((ROOT / "docs").glob("*.md"))


def env() -> dict[str, str]:
    bin_dir = str(BIN if BIN.exists() else Path(sys.executable).parent)
    return dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""), PYTHONUNBUFFERED="1")


def code_blocks(path: Path, langs: tuple[str, ...]) -> list[str]:
    text = path.read_text()
    return [m.group(2) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M) if m.group(1) in langs]


def commands(path: Path) -> list[str]:
    """Non-empty command lines of the file's bash/sh blocks, comments stripped (continuations joined)."""
    out = []
    for block in code_blocks(path, ("bash", "sh")):
        for line in block.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True)
            if tokens:
                out.append(shlex.join(tokens))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout, shell=isinstance(cmd, str), **kw
    )
    assert proc.returncode == 0, f"{cmd!r} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


class Server:
    """A `prefixkv serve` subprocess on a free port, stopped on exit."""

    def __init__(self, argv: list[str], port: int):
        self.argv, self.base = argv, f"http://127.0.0.1:{port}"

    def __enter__(self):
        import httpx

        self.log = (
            open(ROOT / ".pytest_cache" / f"readme_serve_{os.getpid()}.log", "w+")
            if (ROOT / ".pytest_cache").is_dir()
            else subprocess.DEVNULL
        )
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env(), stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"{self.argv} exited with {self.proc.returncode}"
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"{self.argv}: /health never answered 200")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.log is not subprocess.DEVNULL:
            self.log.close()


# ------------------------------------------------------------------------------ README

README = ROOT / "README.md"
README_COMMANDS = commands(README)


def readme_kind(cmd: str) -> str:
    tokens = shlex.split(cmd)
    if tokens[:2] == ["make", "test"]:
        return "skip"  # `make test` runs the whole suite, this test included
    if tokens[0] == "make":
        return "make"
    if len(tokens) > 1 and tokens[0].endswith("prefixkv") and tokens[1] == "serve":
        return "serve"
    return "run"


def test_readme_has_the_snippets_this_test_expects():
    kinds = [readme_kind(c) for c in README_COMMANDS]
    assert {"make", "serve", "run"} <= set(kinds), README_COMMANDS
    assert code_blocks(README, ("python",)), "the README's Python example is gone"


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(code_blocks(README, ("python",)))))
def test_readme_python_example_runs(index):
    block = code_blocks(README, ("python",))[index]
    proc = run([PY, "-c", block])
    m = re.search(r"(\d+) of (\d+) prompt tokens from the cache", proc.stdout)
    if m:  # the prefix-caching example: the second question reuses the document
        assert int(m.group(1)) > 0.8 * int(m.group(2)), proc.stdout


@pytest.mark.parametrize(
    "cmd",
    [
        # only the replay needs no model: everything else is slow
        pytest.param(c, marks=() if "replay" in shlex.split(c) else pytest.mark.slow, id=c)
        for c in README_COMMANDS
        if readme_kind(c) in ("run", "make")
    ],
)
def test_readme_command_runs(cmd):
    tokens = shlex.split(cmd)
    if tokens[0] == "make":
        proc = run(["make", "-o", ".venv/.installed", *tokens[1:]])
        if tokens[1:] == ["demo"]:
            assert "What this shows" in proc.stdout and "prompt tokens from the cache" in proc.stdout
        return
    proc = run(cmd)
    assert proc.stdout.strip(), f"{cmd!r} printed nothing"


@pytest.mark.slow
@pytest.mark.parametrize("cmd", [c for c in README_COMMANDS if readme_kind(c) == "serve"])
def test_readme_serve_command_serves(cmd):
    import httpx

    tokens, port = shlex.split(cmd), free_port()
    if "--port" in tokens:
        tokens[tokens.index("--port") + 1] = str(port)
    else:
        tokens += ["--port", str(port)]
    with Server(tokens, port) as server:
        r = httpx.post(
            server.base + "/v1/completions",
            timeout=120,
            json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] > 0
        assert httpx.get(server.base + "/metrics", timeout=10).status_code == 200


# ------------------------------------------------------------------------------ docs


@cache
def help_text(argv: tuple[str, ...]) -> str:
    if argv[0] != PY:  # another program (lm_eval): on its own
        return run([*argv, "--help"], timeout=300).stdout
    result = python_help_texts()[json.dumps(list(argv[1:]))]
    assert result["status"] == 0, f"{argv[1:]} --help exited {result['status']}:\n{result['err'][-3000:]}"
    return str(result["out"])


@cache
def python_help_texts() -> dict[str, dict[str, object]]:
    """The --help of every Python program the docs name, all run in one process (tests/help_texts.py):
    one import of torch instead of one per program."""
    programs = sorted(
        {checked[0][1:] for _, cmd in DOC_COMMANDS if (checked := help_argv(cmd)) is not None and checked[0][0] == PY}
    )
    out = run([PY, str(ROOT / "tests" / "help_texts.py"), json.dumps([list(p) for p in programs])], timeout=600).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def help_argv(cmd: str) -> tuple[tuple[str, ...], list[str]] | None:
    """(argv whose --help lists the flags, the flags given) for a command, or None if not checked."""
    tokens = shlex.split(cmd)
    while tokens and re.fullmatch(r"[A-Z_]+=.*", tokens[0]):
        tokens = tokens[1:]
    prog, rest = tokens[0], tokens[1:]
    flags = [t.split("=")[0] for t in rest if t.startswith("--")]
    if prog.startswith("peers/"):  # a peer engine's venv runs it (bench/peers/README.md): not installed here
        if rest and rest[0].startswith("bench/") and not rest[0].startswith("bench/peers/"):
            # a benchmark both engines run (bench/step_times.py): its flags are checked with ours
            assert (ROOT / rest[0]).is_file(), f"{cmd!r}: no such script"
            return (PY, rest[0]), flags
        return None
    if prog.endswith(("python", "python3")) and rest[:2] == ["-m", "pytest"]:
        return None
    if prog.endswith(("python", "python3")) and rest and rest[0].startswith("bench/"):
        assert (ROOT / rest[0]).is_file(), f"{cmd!r}: no such script"
        return (PY, rest[0]), flags
    if Path(prog).name in ("lm_eval", "lm-eval"):  # lm-evaluation-harness (the eval extra) on local tasks
        if "--include_path" in rest:
            assert (ROOT / rest[rest.index("--include_path") + 1]).is_dir(), f"{cmd!r}: no such task folder"
        return (str(BIN / "lm_eval"), "run"), flags
    if prog.endswith(("python", "python3")) and rest[:2] == ["-m", "prefixkv.cli"]:
        rest = rest[2:]
    elif Path(prog).name != "prefixkv":
        return None
    return (PY, "-m", "prefixkv.cli", rest[0]), flags


DOC_COMMANDS = [(path.name, cmd) for path in [README, *DOCS] for cmd in commands(path)]


@pytest.mark.parametrize(("doc", "cmd"), DOC_COMMANDS, ids=[f"{doc}: {cmd}" for doc, cmd in DOC_COMMANDS])
def test_doc_command_names_real_scripts_and_flags(doc, cmd):
    tokens = shlex.split(cmd)
    if tokens[0] == "make":
        run(["make", "-n", "-o", ".venv/.installed", *tokens[1:]])
        return
    checked = help_argv(cmd)
    if checked is None:
        return
    argv, flags = checked
    text = help_text(argv)
    for flag in flags:
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), f"{doc}: {cmd!r}: {flag} is not in --help"


def _example_script(cmd: str) -> bool:
    """An example script run as documented (tests/pipeline covers its API; running it would cost
    the suite two engines), or a script for a peer engine's venv: it must exist."""
    tokens = shlex.split(cmd)
    if len(tokens) == 2 and tokens[0].endswith("python") and tokens[1].startswith("examples/"):
        assert (ROOT / tokens[1]).is_file(), f"{cmd!r}: no such example"
        return True
    if tokens[0].startswith("peers/") and len(tokens) > 1 and tokens[1].startswith("bench/peers/"):
        assert (ROOT / tokens[1]).is_file(), f"{cmd!r}: no such script"
        return True
    return False


def test_every_doc_command_is_checked_or_deliberately_skipped():
    unknown = [
        (doc, c)
        for doc, c in DOC_COMMANDS
        if shlex.split(c)[0] != "make" and help_argv(c) is None and "pytest" not in c and not _example_script(c)
    ]
    assert not unknown, f"doc commands this test does not know how to check: {unknown}"


@pytest.mark.slow
def test_serving_doc_openai_snippet_runs():
    serving = ROOT / "docs" / "serving.md"
    snippet = code_blocks(serving, ("python",))[0]
    assert 'api_key="sk-local"' in snippet and 'model="smol"' in snippet
    port = free_port()
    snippet = snippet.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    argv = [
        str(BIN / "prefixkv"),
        "serve",
        "--port",
        str(port),
        "--api-key",
        "sk-local",
        "--served-model-name",
        "smol",
        "--kv-cache-memory-bytes",
        "256M",
    ]
    with Server(argv, port):
        proc = run([PY, "-c", snippet], timeout=300)
    assert proc.stdout.strip()


def test_demo_document_is_the_benchmarks_seed_prompt():
    """make demo and bench/seed_scenario.py time the same prompts (the demo keeps its own copy)."""
    from bench import scenarios
    from prefixkv import demo

    assert demo.DOCUMENT == scenarios.LONG_PROMPT
    assert demo.question("Zack Blue") == scenarios.age_question("Zack Blue")
    assert demo.MAX_TOKENS == scenarios.SEED_MAX_TOKENS


def test_no_machine_paths_or_outside_references_in_code():
    pattern = re.compile(r"/work/|/root/|\.\./shared|shared/seeds|SPEC\.md")
    files = [*sorted((ROOT / "prefixkv").rglob("*.py")), *sorted((ROOT / "bench").rglob("*.py"))]
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in files
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, hits
