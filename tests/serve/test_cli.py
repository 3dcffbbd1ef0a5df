"""``keye serve --model keye-tiny`` as a user starts it: a separate process, offline, answering the client."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.serve.conftest import free_port


@pytest.mark.slow
def test_keye_serve_command_answers_the_openai_client(tmp_path):
    from openai import OpenAI

    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "keye.cli", "serve", "--model", "keye-tiny", "--port", str(port), "--device", "cpu",
         "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        deadline = time.time() + 120
        while True:
            try:
                models = client.models.list()
                break
            except Exception:  # noqa: BLE001 - not listening yet
                if proc.poll() is not None or time.time() > deadline:
                    out = proc.stdout.read() if proc.poll() is not None else ""
                    pytest.fail(f"keye serve did not come up (exit {proc.poll()}):\n{out}")
                time.sleep(0.3)
        assert [m.id for m in models.data] == ["keye-tiny"]
        r = client.chat.completions.create(model="keye-tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length")
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
