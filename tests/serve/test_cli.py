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


def test_a_busy_port_is_one_line_naming_it_before_the_model_loads(monkeypatch, capsys):
    import socket

    from keye.cli import main
    from keye.demo.engine import ModelHost

    def no_load(self):
        raise AssertionError("the model must not load when the port is busy")

    monkeypatch.setattr(ModelHost, "load_now", no_load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 1
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1, (out, lines)
    assert lines[0].startswith(f"keye: error: port {port} on 127.0.0.1 is already in use"), lines
