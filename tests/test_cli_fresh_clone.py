"""What a new user runs first works on a fresh clone: the benchmarks make the data they read, and every
README command that reads the synthetic set comes after the command that makes it."""

from __future__ import annotations

import re
import sys

from tests.paths import REPO_ROOT


def _rl_async():
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        import rl_async
    finally:
        sys.path.remove(str(REPO_ROOT / "benchmarks"))
    return rl_async


def test_rl_async_makes_its_prompts_on_a_fresh_clone(tmp_path, monkeypatch):
    rl_async = _rl_async()
    monkeypatch.chdir(tmp_path)  # no data/synth here, as on a fresh clone
    said = []
    manifest = rl_async.synth_manifest(rl_async.DEFAULT_MANIFEST, tmp_path / "made", 3, log=said.append)
    rows = (tmp_path / "made" / "synth" / "train.jsonl").read_text().splitlines()
    assert manifest == str(tmp_path / "made" / "synth" / "train.jsonl") and len(rows) == 3
    assert len(said) == 1 and "keye data synth --out data/synth" in said[0]
    # an existing manifest is used as it is; a missing one the user named is an error naming it
    assert rl_async.synth_manifest(manifest, tmp_path / "other", 3, log=said.append) == manifest
    try:
        rl_async.synth_manifest("mine.jsonl", tmp_path / "other", 3)
    except SystemExit as err:
        assert "mine.jsonl: manifest file not found" in str(err)
    else:
        raise AssertionError("a missing manifest the user named must stop the benchmark")


def test_benchmarks_read_no_data_they_do_not_make():
    """No benchmark script reads the repository's data/ folder without making it (rl_async generates its
    prompts when data/synth is missing; the others render their own clips into a temporary folder)."""
    readers = {}
    for script in sorted((REPO_ROOT / "benchmarks").glob("*.py")):
        text = script.read_text()
        if re.search(r"[\"']data/", text):
            readers[script.name] = text
    assert set(readers) <= {"rl_async.py"}, sorted(readers)
    assert "def synth_manifest" in readers.get("rl_async.py", "def synth_manifest")


def _readme_code() -> list[tuple[int, str]]:
    """The README's command lines (inside code fences, comments left out), with their line numbers."""
    code, fenced = [], False
    for i, line in enumerate((REPO_ROOT / "README.md").read_text().splitlines()):
        if line.startswith("```"):
            fenced = not fenced
        elif fenced and not line.lstrip().startswith("#"):
            code.append((i, line.split("  #")[0]))
    return code


def test_readme_reads_only_runs_an_earlier_command_writes():
    made, missing = set(), []
    for _, line in _readme_code():
        outputs = set(re.findall(r"(?:--out |checkpoint\.out_dir=)(runs/[\w.]+)", line))
        for path in set(re.findall(r"runs/[\w.]+", line)) - outputs:
            if path not in made:
                missing.append(f"{path} in: {line.strip()}")
        made |= outputs
    assert not missing, missing


def test_readme_makes_the_synthetic_set_before_any_command_reads_it():
    code = _readme_code()
    makes = next(i for i, line in code if line.lstrip().startswith("keye data synth --out data/synth"))
    readers = [(i, line) for i, line in code if "data/synth/" in line]
    assert readers and all(i > makes for i, _ in readers), [line for i, line in readers if i < makes]
