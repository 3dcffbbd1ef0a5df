"""Every benchmark's quick mode runs on a fresh clone and prints its documented last line.

The scripts are discovered (every ``benchmarks/*.py`` but the ``_``-prefixed helpers), so a new benchmark is
covered as soon as it exists. Each one's ``--quick`` run (the same code path at a size that takes seconds,
``benchmarks/_quick.py``) must:

- run from an empty working directory, as on a fresh clone: nothing under ``data/`` or ``runs/`` exists there,
  so a script that reads data it does not make fails here;
- end with a line of the format its docstring states after ``Last line:`` in double backquotes. In that template
  a placeholder such as ``X.XX``, ``Y.YYx``, ``N`` or ``N.N%`` (one capital letter, repeated, optionally with
  decimals and an ``x`` or ``%`` suffix) and any literal number (sizes such as ``64 GPUs``) stand for a number,
  ``a|b`` for either word, and the rest must match exactly; scripts whose docstrings state no template are
  checked against :data:`LAST_LINES`;
- pass the sanity checks of :data:`CHECKS` (values equal, the same training, staleness bounds): the test holds
  no speed threshold, since quick sizes on a loaded machine say nothing about speed.

A script whose ``main`` takes the command line (``main(argv)``) runs in this process, sharing one torch import;
any other runs as ``python benchmarks/<name>.py --quick``. Scripts that need fresh processes (the memory
benchmarks) start them themselves. (This module replaces tests/test_benchmarks_sft_memory.py, whose quick run and
row check are here; tests/test_benchmarks_rl_memory.py keeps rl_memory's unit tests.)
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO_ROOT

BENCHMARKS = REPO_ROOT / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))

NUMBER = r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:e[-+]?\d+)?"
# a placeholder word of a template: one capital letter repeated (X, XX, X.XX, N.N), then an optional suffix
PLACEHOLDER = re.compile(r"([A-Z])\1*(?:\.\1+)?[x%]?")
LITERAL_NUMBER = re.compile(r"\d+(?:\.\d+)?[x%]?")

# last-line formats of scripts whose docstrings state no ``Last line: ``...```` template (their owners' words)
LAST_LINES = {
    "loader": "steps/s on video rows, 2 prefetching workers vs decoding in the training process: X.XXx (ideal Y.YYx: "
              "decoding as long as the step)",
    "balance": "max/mean per-rank cost, ours: X.XXXX (token-count-only Y.YYYY, random Z.ZZZZ)",
    "plan_epoch": "epoch plan of N rows for N ranks: X.XX s (target < 10 s); at N rows X.Xx faster than the old "
                  "planner (same plan: yes)",
}


def template_regex(template: str) -> re.Pattern:
    """The regex of a ``Last line:`` template (see the module docstring); a run of whitespace in the template
    matches any run of whitespace."""
    parts = []
    for word in template.split():
        # peel punctuation off both ends so that "(X.XXx;" has the placeholder "X.XXx" at its core
        m = re.fullmatch(r"([(\[{<\"']*)(.*?)([)\]}>\"',;:.]*)", word)
        lead, core, tail = m.groups()
        if "|" in core and all(re.fullmatch(r"[\w-]+", w) for w in core.split("|")):
            body = "(?:" + "|".join(re.escape(w) for w in core.split("|")) + ")"
        elif PLACEHOLDER.fullmatch(core) or LITERAL_NUMBER.fullmatch(core):
            # a number only: a ratio printed as nan or inf fails the format
            body = f"(?:{NUMBER})" + re.escape(core[-1] if core[-1] in "x%" else "")
        else:
            body = re.escape(core)
        parts.append(re.escape(lead) + body + re.escape(tail))
    return re.compile(r"\s+".join(parts))


def documented_last_line(name: str) -> str:
    """The last-line template stated in ``benchmarks/<name>.py``'s docstring (``Last line: ``...````, whitespace
    collapsed), else :data:`LAST_LINES`'s entry; fails the test when neither exists."""
    source = (BENCHMARKS / f"{name}.py").read_text()
    doc = re.match(r'\s*(?:#.*\n\s*)*[rRuU]?"""(.*?)"""', source, re.S)
    m = re.search(r"last line(?: \([^)]*\))?:\s*``(.+?)``", doc.group(1) if doc else "", re.S | re.I)
    if m:
        return " ".join(m.group(1).split())
    if name in LAST_LINES:
        return LAST_LINES[name]
    pytest.fail(f"benchmarks/{name}.py: its docstring states no last-line format (``Last line: ``...```` with "
                "placeholders such as X.XXx); add one")


def _numbers(line: str) -> list[float]:
    return [float(x.replace(",", "")) for x in re.findall(NUMBER, line)]


def _rl_async(lines: list[str]) -> None:
    runs = [line for line in lines if re.match(r"\s+run \d+ (sync|async)", line)]
    assert {line.split()[2].rstrip(":") for line in runs} == {"sync", "async"}, lines
    for line in runs:  # every trained answer's staleness within the run's bound: 0 for sync, 1 for async
        hist = {int(k): v for k, v in re.findall(r'"(\d+)": (\d+)', line)}
        assert hist and max(hist) <= (0 if " sync" in line else 1), line
    summary = next(line for line in lines if line.startswith("simulated ") and "ceiling" in line)
    assert "CPU-measured decode costs" in summary and "GPU-like decoding" in summary, summary
    for ratio, cap in re.findall(r"(\d+\.\d+)x[^(]*\(ceiling (\d+\.\d+)x", summary):
        assert 0 < float(ratio) <= float(cap) + 0.01, summary  # a schedule beats no ceiling of its own workload


def _rl_memory(lines: list[str]) -> None:
    assert re.search(r"both layouts trained the same model .*: yes$", lines[-2]), lines[-2]


def _sft_memory(lines: list[str]) -> None:
    # 1,024 tokens of full logits and autograd's copies of them against two 512-row chunks (2.4x measured)
    assert float(re.search(r"(\d+\.\d+)x less", lines[-1]).group(1)) > 1.3, lines


def _cli_startup(lines: list[str]) -> None:
    for line in lines[:2]:  # the command line answers without importing torch or transformers
        assert line.startswith("keye") and "no torch, no transformers" in line, line


# extra checks of a quick run's printed lines, beyond the last line's format
CHECKS = {"rl_async": _rl_async, "rl_memory": _rl_memory, "sft_memory": _sft_memory, "cli_startup": _cli_startup}


def _import(name: str):
    """``benchmarks/<name>.py`` as the module ``name`` (the name its spawned children import it by), with the
    benchmarks folder first on ``sys.path`` (the scripts import their ``_``-helpers and each other by name)."""
    sys.modules.pop(name, None)
    module = importlib.import_module(name)
    assert Path(module.__file__).resolve() == BENCHMARKS / f"{name}.py", module.__file__
    return module


def run_quick(name: str, capsys) -> list[str]:
    """The printed lines of ``benchmarks/<name>.py --quick`` run in the current directory."""
    sys.path.insert(0, str(BENCHMARKS))
    before = set(sys.modules)
    try:
        module = _import(name)
        if "argv" in inspect.signature(module.main).parameters:
            module.main(["--quick"])
            return capsys.readouterr().out.splitlines()
    finally:
        sys.path.remove(str(BENCHMARKS))
        for helper in set(sys.modules) - before:  # the benchmarks' own modules: names such as "model", "tree"
            if Path(getattr(sys.modules[helper], "__file__", None) or "/").parent == BENCHMARKS:
                del sys.modules[helper]
    proc = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), "--quick"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"benchmarks/{name}.py --quick failed:\n{proc.stderr[-3000:]}"
    return proc.stdout.splitlines()


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_quick_mode_prints_the_documented_last_line(name, tmp_path, monkeypatch, capsys):
    import torch

    template = documented_last_line(name)
    monkeypatch.chdir(tmp_path)  # a fresh clone's view: no data/synth, no runs/ in the working directory
    # one torch thread, as the quick modes use (benchmarks/_quick.py): two threads on a loaded 2-core machine spin
    # for each other's core, which made a 2-second quick run take 40
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    lines = [line for line in run_quick(name, capsys) if line.strip()]
    assert lines, f"benchmarks/{name}.py --quick printed nothing"
    assert template_regex(template).fullmatch(lines[-1].strip()), (
        f"benchmarks/{name}.py --quick: last line\n  {lines[-1]!r}\ndoes not match its documented format\n  {template!r}")
    assert all(math.isfinite(x) for x in _numbers(lines[-1])), lines[-1]
    if name in CHECKS:
        CHECKS[name](lines)


def test_sft_memory_row_is_packed_with_prompts_outside_the_loss():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        sft_memory = _import("sft_memory")
    finally:
        sys.path.remove(str(BENCHMARKS))
        sys.modules.pop("sft_memory", None)
    mb = sft_memory.build_row(2500, vocab=5000)
    assert mb["seq_lens"].tolist() == [1024, 1024, 452] and mb["input_ids"].shape == (1, 2500)
    assert mb["num_label_tokens"] == 2500 - 3 * sft_memory.PROMPT_TOKENS
    assert int(mb["input_ids"].min()) >= 1000


def test_every_benchmark_documents_its_last_line():
    missing = [name for name in SCRIPTS if name not in LAST_LINES
               and not re.search(r"last line(?: \([^)]*\))?:\s*``", (BENCHMARKS / f"{name}.py").read_text(), re.I)]
    assert not missing, missing


@pytest.mark.parametrize("template, line, ok", [
    ("speedup tree vs unshared (forward+backward, one group): X.XXx",
     "speedup tree vs unshared (forward+backward, one group): 3.76x", True),
    ("speedup tree vs unshared (forward+backward, one group): X.XXx",
     "speedup tree vs unshared (forward+backward, one group): 3.76", False),  # the x is part of the format
    ("rl throughput async vs sync: measured X.XXx, simulated 64 GPUs Y.YYx",
     "rl throughput async vs sync: measured 1.41x, simulated 8 GPUs 2.00x", True),
    ("rl throughput async vs sync: measured X.XXx, simulated 64 GPUs Y.YYx",
     "rl throughput async vs sync: simulated 64 GPUs 2.00x", False),
    ("a vs b: X.XXx less (values equal: yes)", "a vs b: 2.40x less (values equal: no)", False),
    ("within 10 %: yes|no)", "within 10 %: no)", True),
    ("speedup: X.XXx", "speedup: nanx", False),
    ("full spec vs format-only (median rewards/s): X.XXx (N vs M)",
     "full spec vs format-only (median rewards/s): 0.05x (3,712 vs 86,012)", True),
])
def test_template_regex(template, line, ok):
    assert bool(template_regex(template).fullmatch(line)) == ok


def test_quick_sizes_yield_to_the_command_line():
    import argparse

    sys.path.insert(0, str(BENCHMARKS))
    try:
        from _quick import parse_args
    finally:
        sys.path.remove(str(BENCHMARKS))

    def parser():
        ap = argparse.ArgumentParser()
        ap.add_argument("--repeats", type=int, default=5)
        ap.add_argument("--tokens", type=int, default=4096)
        return ap

    quick = {"repeats": 1, "tokens": 64}
    assert vars(parse_args(parser(), [], quick)) == {"repeats": 5, "tokens": 4096, "quick": False}
    assert vars(parse_args(parser(), ["--quick"], quick)) == {"repeats": 1, "tokens": 64, "quick": True}
    assert vars(parse_args(parser(), ["--quick", "--repeats", "3"], quick)) == {"repeats": 3, "tokens": 64,
                                                                                 "quick": True}
    with pytest.raises(ValueError, match="toknes"):
        parse_args(parser(), ["--quick"], {"toknes": 64})
