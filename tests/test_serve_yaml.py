"""`serve run deploy/serve.yaml`, Ray's own CLI on the repository's Serve config as
it is, against a running local Ray cluster that offers the `verifier` and
`drafter` resources: once /health says ready, a chat completion with a key made by
`specserve keys create` is answered, and one without a valid key is refused."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import ray
import yaml

from cluster.ray_start import start_local_ray

REPO = Path(__file__).resolve().parents[1]
SERVE_YAML = REPO / "deploy" / "serve.yaml"
READY_TIMEOUT_S = 300


def _health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def test_serve_run_deploy_yaml_answers_a_chat_completion():
    port = yaml.safe_load(SERVE_YAML.read_text())["http_options"]["port"]
    base = f"http://127.0.0.1:{port}"
    start_local_ray(num_cpus=2, resources={"verifier": 1, "drafter": 1}, include_dashboard=False, log_to_driver=False)
    proc, printed, stopped = None, [], True
    try:
        serve_cli = shutil.which("serve")
        assert serve_cli, "Ray's `serve` command is not installed"
        # serve run prints the cluster's logs: read them as they come, or once the pipe is full its
        # writes block, Ctrl-C's handler among them, and the application is never deleted
        proc = subprocess.Popen([serve_cli, "run", "--address", ray.get_runtime_context().gcs_address,
                                 str(SERVE_YAML)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        threading.Thread(target=lambda: printed.extend(iter(proc.stdout.readline, "")), daemon=True).start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while _health(f"{base}/health") != 200:
            assert proc.poll() is None, "".join(printed)
            assert time.monotonic() < deadline, "the application never said it was ready"
            time.sleep(1.0)
        # the config asks for keys: make one with the CLI, in the cluster's embedded store
        env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
        env.pop("SPECSERVE_REDIS_URL", None)
        made = subprocess.run([sys.executable, "-m", "commands.cli", "keys", "create", "--name", "yaml-test"],
                              capture_output=True, text=True, env=env, timeout=120)
        assert made.returncode == 0, made.stderr
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="not-a-key", timeout=60).models.list()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=json.loads(made.stdout)["key"], timeout=120)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                           max_tokens=8, temperature=0)
        assert r.choices[0].message.content and r.usage.completion_tokens == 8
        assert json.loads(r.model_dump_json())["usage"]["drafters"]  # the speculation figures came along
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # serve run deletes the application on Ctrl-C
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                stopped = False
        ray.shutdown()
    assert stopped, "serve run did not stop within 60 s of Ctrl-C:\n" + "".join(printed[-50:])
