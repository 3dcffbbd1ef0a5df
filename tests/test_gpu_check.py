"""scripts/gpu_check.py on a CPU host: ``--help`` works, a run without CUDA says so and exits 2, and the checks
whose logic runs on CPU (golden parity in float32 and bfloat16, the rows that skip without their package) give
the expected rows."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "gpu_check.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU even on a GPU host
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("gpu_check", None)


def test_help_lists_the_checks_and_options():
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    for word in ("--only", "--model", "--max-logp-diff", "golden", "flash", "context", "memory", "vllm", "needs CUDA"):
        assert word in proc.stdout, word


def test_without_cuda_it_says_so_and_exits_2():
    proc = _run("--only", "golden")
    assert proc.returncode == 2
    assert "needs CUDA" in proc.stderr and proc.stdout == ""


def test_golden_rows_pass_on_cpu_and_a_wrong_model_fails(gpu_check, monkeypatch):
    """The golden logic is device-agnostic: fp32 on CPU is the goldens' own setting, bf16 on CPU measures
    about 3.2u relative error, under the 8u bound the GPU row uses. A model one precision step worse (its
    RMSNorm weights rounded to 4 significand bits) must fail the bf16 bound."""
    import torch

    cases = ("text_only", "image_text")  # a text and an image case keep the CPU bf16 run short
    fp32 = gpu_check.check_golden("cpu", "float32", cases)
    bf16 = gpu_check.check_golden("cpu", "bfloat16", cases)
    assert fp32.status == "PASS" and bf16.status == "PASS", (fp32, bf16)
    assert "rel L2" in bf16.value and "0.0312" in bf16.limit and "(2 cases)" in bf16.check

    from keye import KeyeVL

    real = KeyeVL.from_pretrained

    def coarse(*a, **kw):
        model = real(*a, **kw)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    m, e = torch.frexp(p.float())
                    p.copy_(torch.ldexp(torch.round(m * 16) / 16, e))
        return model

    monkeypatch.setattr(KeyeVL, "from_pretrained", coarse)
    assert gpu_check.check_golden("cpu", "bfloat16", cases).status == "FAIL"


def test_rows_without_their_package_skip_with_a_reason(gpu_check, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    row = gpu_check.check_vllm("cpu", None, 0.05, 0.4)
    assert row.status == "SKIP" and "vllm" in row.note
    import keye.model.attention as attention

    monkeypatch.setattr(attention, "flash_attn_available", lambda: False)
    row = gpu_check.check_flash_vision("cpu")
    assert row.status == "SKIP" and "flash_attn" in row.note
    cp_row = gpu_check.check_context_parallel("cpu")
    assert cp_row.status == "SKIP" and "flash_attn" in cp_row.note
    text = gpu_check.table([row, gpu_check.Row("x", "PASS", "1.0", "<= 2")])
    assert "SKIP" in text and "PASS" in text and "<= 2" in text
