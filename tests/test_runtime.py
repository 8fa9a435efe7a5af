"""The CLI's thread-wait policy (specdraft.runtime): set before torch loads, never over the user's choice."""

import os
import subprocess
import sys

from specdraft.runtime import prefer_active_wait


def test_active_unless_set_or_several_ranks():
    env = {}
    assert prefer_active_wait(env) == "ACTIVE" and env["OMP_WAIT_POLICY"] == "ACTIVE"
    env = {"OMP_WAIT_POLICY": "PASSIVE"}
    assert prefer_active_wait(env) == "PASSIVE" and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"WORLD_SIZE": "2"}  # ranks of torchrun share the cores: spinning would make them fight
    assert prefer_active_wait(env) == "unset" and "OMP_WAIT_POLICY" not in env
    env = {"WORLD_SIZE": "1"}
    assert prefer_active_wait(env) == "ACTIVE"


def _cli_policy(extra: dict) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "WORLD_SIZE")} | extra
    code = "import os, sys, specdraft.cli; print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_cli_sets_policy_before_torch_loads():
    assert _cli_policy({}) == ["ACTIVE", "False"]  # set, and torch (libgomp) not loaded yet, so it takes effect
    assert _cli_policy({"OMP_WAIT_POLICY": "PASSIVE"}) == ["PASSIVE", "False"]
