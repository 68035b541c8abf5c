"""`prefixkv serve --replicas` flags: refused combinations name themselves before Ray starts, and
without --replicas nothing imports Ray."""

from __future__ import annotations

import subprocess
import sys

import pytest

from prefixkv.cli import build_parser
from prefixkv.replicas.args import check_replica_args, check_single_engine_args

from .conftest import ROOT


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_single_engine_serve_does_not_import_ray():
    code = (
        "import sys; from prefixkv.cli import build_parser, engine_config; "
        "a = build_parser().parse_args(['serve', '--router', 'prefix']); engine_config(a); "
        "import prefixkv.server.app; assert 'ray' not in sys.modules, 'ray imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--replicas", "0"], "--replicas must be >= 1"),
        (["--replicas", "2", "--kv-events-config", '{"enable_kv_cache_events": true}'], "--kv-events-config"),
        (["--replicas", "2", "--max-queue", "0"], "max_queue >= 1"),
        (["--replicas", "2", "--prefix-caching-hash-algo", "xxhash"], "seeded per process"),
        (["--replicas", "2", "--router-poll-interval", "0"], "--router-poll-interval > 0"),
    ],
)
def test_refused_combinations_name_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        check_replica_args(parse(*argv))


def test_approx_index_accepts_a_per_process_hash():
    check_replica_args(parse("--replicas", "2", "--prefix-caching-hash-algo", "xxhash", "--router-index", "approx"))


def test_replicas_zero_fails_at_the_command_line():
    res = subprocess.run(
        [sys.executable, "-m", "prefixkv.cli", "serve", "--replicas", "0"], cwd=ROOT, capture_output=True, text=True
    )
    assert res.returncode == 2 and "--replicas must be >= 1" in res.stderr


def test_router_flags_without_replicas_are_refused_by_name():
    check_single_engine_args(parse())  # nothing given: fine
    with pytest.raises(ValueError, match="--router, --max-queue: used only with --replicas"):
        check_single_engine_args(parse("--router", "prefix", "--max-queue", "3"))
    res = subprocess.run(
        [sys.executable, "-m", "prefixkv.cli", "serve", "--router-index", "approx"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0 and "--router-index: used only with --replicas" in res.stderr


def test_prefix_load_knobs_with_another_router_are_refused_by_name():
    with pytest.raises(ValueError, match="--max-kv-usage: knobs of --router prefix-load only, not of prefix"):
        check_replica_args(parse("--replicas", "2", "--router", "prefix", "--max-kv-usage", "0.5"))
    check_replica_args(parse("--replicas", "2", "--router", "round-robin"))  # defaults: fine
