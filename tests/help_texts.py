"""Print, as one JSON object, the `--help` of several Python programs run in this one process.

    python tests/help_texts.py '[["bench/step_times.py"], ["-m", "prefixkv.cli", "serve"]]'

tests/test_readme.py checks every flag the docs give a bench script or a prefixkv subcommand
against its --help. Run one process per program, the ~40 programs cost ~80 s of the suite's two
cores, nearly all of it importing torch again; here each runs as `python PROGRAM --help` would
(`runpy`, as `__main__`, its argv set), after the first import, in a fraction of a second.

Per program: {"status": exit status, "out": its standard output, "err": its standard error or the
exception that ended it}."""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
import traceback


def help_of(argv: list[str]) -> dict[str, object]:
    out, err = io.StringIO(), io.StringIO()
    status = 0
    saved_argv, saved_path = sys.argv, list(sys.path)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:], "--help"]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = [argv[0], *argv[1:], "--help"]
                runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - reported as the program's failure
            status = 1
            traceback.print_exc()
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path
    return {"status": status, "out": out.getvalue(), "err": err.getvalue()}


def main() -> None:
    programs = json.loads(sys.argv[1])
    print(json.dumps({json.dumps(p): help_of(p) for p in programs}))


if __name__ == "__main__":
    main()
