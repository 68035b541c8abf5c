"""prefixkv asks OpenMP for passive waiting unless the user chose (prefixkv/openmp.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from prefixkv.openmp import configure_openmp


def test_sets_passive_where_nobody_chose_and_respects_a_choice():
    env: dict[str, str] = {}
    assert configure_openmp(env) == "PASSIVE" and env["OMP_WAIT_POLICY"] == "PASSIVE"
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "1000"}, {"KMP_BLOCKTIME": "1"}):
        env = dict(chosen)
        assert configure_openmp(env) is None and env == chosen
    env = {"PREFIXKV_OMP_POLICY": "keep"}
    assert configure_openmp(env) is None and "OMP_WAIT_POLICY" not in env


def test_importing_prefixkv_first_sets_it_before_torch_loads():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    code = "import prefixkv, os, torch; print(os.environ.get('OMP_WAIT_POLICY'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "PASSIVE"
    code = "import torch, prefixkv, os; print(os.environ.get('OMP_WAIT_POLICY'))"  # too late: left alone
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"
