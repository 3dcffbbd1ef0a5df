"""The README's screenshot (docs/demo.png) shows what the demo shows now: demo/make_screenshot.py records the
page's figures beside it (docs/demo.json), and here they are recomputed with the page's own handler on
keye-tiny; the script itself says first when there is no browser."""

from __future__ import annotations

import hashlib
import importlib.util
import json

from tests.paths import REPO_ROOT

PNG = REPO_ROOT / "docs" / "demo.png"
FIGURES = REPO_ROOT / "docs" / "demo.json"
REGENERATE = "run `python demo/make_screenshot.py` (needs Chromium: apt-get install -y chromium) and commit both files"


def _script():
    spec = importlib.util.spec_from_file_location("make_screenshot", REPO_ROOT / "demo" / "make_screenshot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_screenshot_shows_what_the_demo_shows_now():
    from keye.demo.app import page_figures
    from keye.demo.engine import ModelHost
    from keye.demo.examples import load_examples

    assert "](docs/demo.png)" in (REPO_ROOT / "README.md").read_text()
    assert FIGURES.is_file(), f"{FIGURES.relative_to(REPO_ROOT)} is missing: {REGENERATE}"
    recorded = json.loads(FIGURES.read_text())
    assert hashlib.sha256(PNG.read_bytes()).hexdigest() == recorded["png_sha256"], (
        f"docs/demo.png is not the picture docs/demo.json describes: {REGENERATE}")
    example = next(e for e in load_examples() if e["video"].endswith("/" + recorded["example"]))
    host = ModelHost("keye-tiny", device="cpu").load_now()
    now = page_figures(host, example)
    stale = {k: (recorded.get(k), v) for k, v in now.items() if recorded.get(k) != v}
    assert not stale, f"docs/demo.png is stale (recorded, now): {stale}; {REGENERATE}"


def test_make_screenshot_says_first_that_there_is_no_browser(tmp_path, monkeypatch, capsys):
    from keye.demo.engine import ModelHost

    def no_load(self):
        raise AssertionError("nothing may load before the browser is found")

    monkeypatch.setattr(ModelHost, "start", no_load)
    monkeypatch.setenv("PATH", str(tmp_path))  # no chromium on it
    assert _script().main(["--out", str(tmp_path / "demo.png")]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["make_screenshot: error: no Chromium browser found on PATH; install it (Debian: apt-get "
                     "install -y chromium)"], lines
    assert not (tmp_path / "demo.png").exists()


def test_make_screenshot_rejects_an_unknown_example(tmp_path, monkeypatch, capsys):
    module = _script()
    monkeypatch.setattr("keye.demo.screenshot.find_browser", lambda: "/usr/bin/true")
    assert module.main(["--example", "7", "--out", str(tmp_path / "x.png")]) == 1
    assert "--example 7: there are 3 examples" in capsys.readouterr().err
