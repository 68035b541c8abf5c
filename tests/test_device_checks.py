"""bench/device/gpu_checks.sh, checked on the CPU: every step it knows runs, with `python3` standing
in as a recorder; then every command it ran has its flags parsed by its own script's parser, and
every test it names is collected. A lent GPU has a few minutes (issue 40): a renamed flag, a
misspelt engine or a renamed test would otherwise be found there, with the lease's time spent."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "device" / "gpu_checks.sh"
FIELD, RECORD = "\x1f", "\x1e"

# run in one process for every command (torch imported once): each command's own parser
# parses its flags, and the command stops there
PARSE_ONLY = r"""
import argparse, json, runpy, sys, traceback

class Parsed(Exception):
    pass

depth = 0

def stop_after(method):
    # parse_args calls parse_known_args, then rejects what is left over: stop after the outer one
    def parse(self, *args, **kwargs):
        global depth
        depth += 1
        try:
            result = method(self, *args, **kwargs)
        finally:
            depth -= 1
        if depth:
            return result
        raise Parsed
    return parse

argparse.ArgumentParser.parse_args = stop_after(argparse.ArgumentParser.parse_args)
argparse.ArgumentParser.parse_known_args = stop_after(argparse.ArgumentParser.parse_known_args)
problems = []
for kind, target, args in json.load(open(sys.argv[1])):
    sys.argv = [target, *args]
    try:
        if kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
        problems.append(f"{target} {args}: ran to its end without parsing its flags")
    except Parsed:
        pass
    except SystemExit as e:  # argparse's error, its message on stderr
        problems.append(f"{target} {args}: exit {e.code}")
    except BaseException:
        problems.append(f"{target} {args}: " + traceback.format_exc(limit=3))
print(json.dumps(problems))
"""


def parse_only(tmp_path: Path, commands: list[tuple[str, str, list[str]]]) -> tuple[list[str], str]:
    """Each command's flags parsed by its own parser, in one process: what went wrong, by
    command, and the process's stderr (argparse's messages)."""
    listed = tmp_path / "commands.json"
    listed.write_text(json.dumps(commands))
    parsed = subprocess.run(
        [sys.executable, "-c", PARSE_ONLY, str(listed)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert parsed.returncode == 0, parsed.stderr[-3000:]
    return json.loads(parsed.stdout.strip().splitlines()[-1]), parsed.stderr


def steps_of(script: str) -> list[str]:
    """The steps the script's `case` knows, in its order."""
    body = script[script.index("case $step in") :]
    return re.findall(r"^    ([a-z0-9_]+)\)", body, flags=re.M)


def run_recorded(tmp_path: Path, steps: list[str]) -> tuple[list[list[str]], str]:
    """Run the script over `steps` with `python3` a recorder: its calls' arguments, and the log."""
    bin_dir, work, out = tmp_path / "bin", tmp_path / "work", tmp_path / "out"
    for d in (bin_dir, work / ".device" / "base", out):
        d.mkdir(parents=True)
    calls = tmp_path / "calls"
    recorder = bin_dir / "python3"
    recorder.write_text(
        f'#!/bin/sh\n{{ for a in "$@"; do printf \'%s\\{oct(ord(FIELD))[2:]}\' "$a"; done; '
        f"printf '\\{oct(ord(RECORD))[2:]}'; }} >> \"$CALLS\"\n"
    )
    recorder.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "STEPS": " ".join(steps),
        "OUT": str(out),
        "CALLS": str(calls),
    }
    run = subprocess.run(
        ["bash", str(SCRIPT)], cwd=work, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, run.stderr
    text = calls.read_text() if calls.exists() else ""
    return [record.split(FIELD)[:-1] for record in text.split(RECORD) if record], run.stdout + run.stderr


@pytest.mark.slow(seconds=12)
def test_every_step_of_the_device_script_parses_its_flags_and_finds_its_tests(tmp_path: Path) -> None:
    script = SCRIPT.read_text()
    steps = steps_of(script)
    assert {"verify", "graphs", "large", "host_ab", "ahead", "gemv"} <= set(steps)
    preset = re.search(r"STEPS/issue40/([^}]+)\}", script)
    assert preset is not None
    unknown = set(preset.group(1).split()) - set(steps)
    assert not unknown, f"the issue40 preset names steps the script does not know: {unknown}"

    calls, log = run_recorded(tmp_path, steps)
    assert "unknown step" not in log
    commands: list[tuple[str, str, list[str]]] = []
    test_ids: set[str] = set()
    for argv in calls:
        if argv[0] == "-c":  # the environment's one-line probe
            continue
        if argv[:2] == ["-m", "pytest"]:
            test_ids.update(a for a in argv[2:] if a.startswith("tests/"))
        elif argv[0] == "-m":
            commands.append(("module", argv[1], argv[2:]))
        else:
            assert argv[0].startswith("bench/"), argv
            commands.append(("path", argv[0], argv[1:]))
    scripts = {target for _, target, _ in commands}
    # every kind of command the steps run was recorded (a step that stopped early would hide the rest)
    assert {
        "bench/decode_graphs.py",
        "bench/host_overhead.py",
        "bench/steps_ahead.py",
        "bench/fused_gemv.py",
    } <= scripts
    assert any("--against" in args for _, target, args in commands if target == "bench/loglikelihood.py")
    assert "tests.engine.sweep_graphs" in scripts

    problems, stderr = parse_only(tmp_path, commands)
    assert not problems, "\n".join(problems) + "\n" + stderr[-3000:]

    assert len(test_ids) > 10
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"] + sorted(test_ids),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]


def test_a_misspelt_list_fails_when_the_flags_are_parsed(tmp_path: Path) -> None:
    """What the check above relies on: a wrong name or number in a comma-separated flag is
    argparse's error, not a KeyError after the first engine was built."""
    cases = [
        (["bench/decode_graphs.py", "--engines", "graphs,eagre"], "eagre not of"),
        (["bench/mixed_steps.py", "--decodes", "1,3a"], "not a comma-separated list"),
        (["bench/fused_gemv.py", "--shapes", "llama-8b"], "llama-8b not of"),
    ]
    problems, stderr = parse_only(tmp_path, [("path", argv[0], argv[1:]) for argv, _ in cases])
    assert len(problems) == len(cases) and all("exit 2" in p for p in problems), problems
    for _, message in cases:
        assert message in stderr
