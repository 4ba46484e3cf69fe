"""The `specserve` command as a user runs it: JSON output, and bad input
answered by one line naming the field, a non-zero exit, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def specserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "commands.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_json_fields():
    r = specserve("generate", "--chat", "--json", "--prompt", "Name three colours.", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 8 and out["finish_reason"] == "length"
    assert out["text"].strip()
    assert out["target_forward_passes"] >= 1
    assert out["mean_accepted_tokens"] == pytest.approx(8 / out["target_forward_passes"], abs=1e-3)
    assert out["seconds"] > 0


def test_generate_streams_text():
    r = specserve("generate", "--chat", "--prompt", "Say hello.", "--max-tokens", "6", "--drafter", "none")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


@pytest.mark.parametrize("args, field", [
    (["--prompt", ""], "--prompt"),
    (["--prompt", "   ", "--chat"], "--prompt"),
    (["--prompt", "hi", "--max-tokens", "0"], "--max-tokens"),
    (["--prompt", "hi", "--max-tokens", "-5"], "--max-tokens"),
    (["--prompt", "hi", "--max-tokens", "9000"], "--max-tokens"),  # beyond the 8192-token context
    (["--prompt", "hi", "--temperature", "-0.1"], "--temperature"),
    (["--prompt", "hi", "--top-p", "0"], "--top-p"),
    (["--prompt", "hi", "--top-p", "1.5"], "--top-p"),
    (["--prompt", "hi", "--top-k", "-1"], "--top-k"),
    (["--prompt", "hi", "--drafter", "nonsense"], "--drafter"),
    (["--prompt", "hi", "--draft-length", "-1"], "--draft-length"),
    (["--prompt", "hi", "--top-k", "two"], "--top-k"),
])
def test_bad_input_is_one_line_naming_the_field(args, field):
    r = specserve("generate", *args)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert field in lines[0], lines[0]
    assert "Traceback" not in r.stderr


def test_serve_refuses_a_short_cluster_secret_before_starting_anything(monkeypatch):
    """A secret every service would refuse is one line from `specserve serve`, not a Ray
    deployment failure after the cluster has started."""
    monkeypatch.setenv("SPECSERVE_CLUSTER_SECRET", "short")
    r = specserve("serve")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "SPECSERVE_CLUSTER_SECRET must be at least 16 characters" in lines[0], r.stderr


def test_the_first_run_says_what_it_makes_once(tmp_path):
    """A fresh cache: the GGUF's conversion is shown, with its steps, not run in silence;
    a later run, the cache made, says nothing of it."""
    import os

    env = {**os.environ, "SPECSERVE_CACHE_DIR": str(tmp_path), "SPECSERVE_CPU_KERNELS": "torch"}
    command = [sys.executable, "-m", "commands.cli", "generate", "--prompt", "Hi", "--max-tokens", "2", "--json"]
    first = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert first.returncode == 0, first.stderr
    assert "converting SmolLM2-135M-Instruct" in first.stderr and "dequantising" in first.stderr
    assert json.loads(first.stdout)["token_ids"]  # stdout stays the answer alone
    again = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert again.returncode == 0 and "converting" not in again.stderr
