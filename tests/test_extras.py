"""Optional features whose packages are extras: without the package, prefixkv still imports and
serves, and asking for the feature is an ImportError naming the extra to install. Each check runs
in a fresh interpreter in which the extra's packages cannot be imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# None in sys.modules: `import x` raises ModuleNotFoundError and importlib.util.find_spec("x")
# returns None, as for a package that is not installed
BLOCK = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None
"""


def _run_without(blocked: set[str], code: str) -> subprocess.CompletedProcess[str]:
    src = BLOCK.format(blocked=blocked) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_imports_without_any_extra() -> None:
    done = _run_without(
        {"redis", "zmq", "msgpack", "imagehash", "scipy", "ray", "xgrammar"},
        "import prefixkv, prefixkv.llm, prefixkv.cli, prefixkv.server.app, prefixkv.engine.llm_engine",
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "blocked, code, extra",
    [
        ({"redis"}, "from prefixkv.tiers.redis import RedisStore; RedisStore('redis://127.0.0.1:1/0')", "redis"),
        (
            {"zmq"},
            "from prefixkv.kv_events import KVEventsConfig, create_publisher;"
            "create_publisher(KVEventsConfig(enable_kv_cache_events=True))",
            "kv-events",
        ),
        (
            {"msgpack"},
            "from prefixkv.kv_events import KVEventsConfig, create_publisher;"
            "create_publisher(KVEventsConfig(enable_kv_cache_events=True))",
            "kv-events",
        ),
        ({"msgpack"}, "from prefixkv.router import PrefixIndex; PrefixIndex().apply_batch('r', b'')", "kv-events"),
        ({"imagehash"}, "from prefixkv.multimodal.hashing import require_phash; require_phash()", "phash"),
        (
            {"xgrammar"},
            "from prefixkv.constraints.grammar import choose_backend; choose_backend('xgrammar')",
            "xgrammar",
        ),
    ],
)
def test_a_feature_without_its_extra_names_it(blocked: set[str], code: str, extra: str) -> None:
    done = _run_without(blocked, code)
    assert done.returncode != 0
    assert "ImportError" in done.stderr and f"pip install 'prefixkv[{extra}]'" in done.stderr, done.stderr


def test_auto_backend_without_xgrammar_is_llguidance() -> None:
    done = _run_without(
        {"xgrammar"}, "from prefixkv.constraints.grammar import choose_backend; print(choose_backend('auto'))"
    )
    assert done.returncode == 0 and done.stdout.strip() == "guidance", done.stderr
