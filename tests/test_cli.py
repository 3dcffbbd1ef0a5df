"""The ``keye`` command line answers at once: help, version and argument errors import neither torch nor
transformers; every option is described with its default; a sub-command reports its own usage."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from keye.cli import ArgumentParser, build_parser, main

# Run in one fresh interpreter, in order; after each, the heavy packages imported so far are recorded.
LIGHT_COMMANDS = [
    ["--help"],
    ["--version"],
    ["chat", "--help"],
    *[[name, "--help"] for name in ("process", "data", "train", "rlep", "init", "merge", "rl", "sft", "eval",
                                     "demo", "serve")],
    ["data", "synth", "--help"],
    ["train", "sft", "--help"],
    ["rl", "plan", "--help"],
    ["sft", "plan", "--help"],
    ["eval", "synth", "--help"],
    ["chat", "--bogus"],  # an unknown flag
    ["chat", "--max-new-tokens", "many", "q"],  # a bad value
    ["serve", "--port", "x"],
    ["chat", "--video", "/nonexistent/missing.mp4", "q"],  # a missing file: reported before any model code
    ["chat", "--video", "still.png", "q"],  # a picture given as a video
]

SCRIPT = r"""
import contextlib, io, json, sys
from keye.cli import main

argvs = json.loads(sys.argv[1])
report = []
for argv in argvs:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code
    heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
    report.append({"argv": argv, "code": code, "heavy": heavy, "out": out.getvalue()[-400:], "err": err.getvalue()[-400:]})
print(json.dumps(report))
"""


def test_help_version_and_argument_errors_import_neither_torch_nor_transformers():
    r = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(LIGHT_COMMANDS)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    first_heavy = next((row for row in report if row["heavy"]), None)
    assert first_heavy is None, f"`keye {' '.join(first_heavy['argv'])}` imported {first_heavy['heavy']}"
    codes = {" ".join(row["argv"]): row["code"] for row in report}
    assert codes["--help"] == 0 and codes["chat --help"] == 0 and codes["--version"] == 0
    assert codes["chat --bogus"] == 2 and codes["chat --max-new-tokens many q"] == 2 and codes["serve --port x"] == 2
    by_argv = {" ".join(row["argv"]): row for row in report}
    assert by_argv["chat --video /nonexistent/missing.mp4 q"]["code"] == 1
    assert "missing.mp4: file not found" in by_argv["chat --video /nonexistent/missing.mp4 q"]["err"]
    assert "still.png: given with --video, but a .png file is an image" in by_argv["chat --video still.png q"]["err"]


def _parsers(parser: argparse.ArgumentParser, prog: str = "keye"):
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{prog} {name}")


def test_every_option_and_argument_is_described():
    undescribed = [f"{prog}: {'/'.join(a.option_strings) or a.dest}" for prog, p in _parsers(build_parser())
                   for a in p._actions
                   if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not (a.help or "").strip()]
    assert not undescribed, undescribed


def test_help_shows_defaults():
    chat = dict(_parsers(build_parser()))["keye chat"].format_help()
    flat = " ".join(chat.split())
    for text in ("--temperature TEMPERATURE with --sample: softmax temperature (> 0; lower is more deterministic) "
                 "(default: 0.7)", "(default: 0.9)", "(default: 50)", "answer budget in tokens (default: 512)",
                 "--model MODEL checkpoint directory, hub id or keye-tiny (default)"):
        assert text in flat, flat
    assert "(default: None)" not in flat and "(default: False)" not in flat
    serve = " ".join(dict(_parsers(build_parser()))["keye serve"].format_help().split())
    assert "(default: 8000)" in serve
    demo = " ".join(dict(_parsers(build_parser()))["keye demo"].format_help().split())
    assert "(default: 7860)" in demo


@pytest.mark.parametrize("argv, usage", [
    (["chat", "--bogus"], "usage: keye chat"),
    (["data", "synth", "--out", "x", "--train", "1", "--test", "1", "--bogus"], "usage: keye data synth"),
    (["eval", "synth", "--model", "m", "--data", "d", "--nope", "1"], "usage: keye eval synth"),
])
def test_an_unknown_flag_prints_the_subcommands_usage(argv, usage, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.startswith(usage), err
    assert "unrecognized arguments: " + argv[-1 if argv[-1].startswith("-") else -2] in err


def test_the_top_level_still_rejects_unknown_flags(capsys):
    with pytest.raises(SystemExit):
        main(["--bogus"])
    assert capsys.readouterr().err.startswith("usage: keye [-h]")


def test_a_formatter_a_command_chooses_keeps_its_layout_and_gets_defaults():
    p = ArgumentParser(prog="x", description="line one\n  kept as written",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=3, help="how many")
    text = p.format_help()
    assert "line one\n  kept as written" in text and "how many (default: 3)" in text


def test_opt_in_types_in_the_help_are_the_generators():
    from keye.data.cli import OPT_IN_TYPES
    from keye.data.synth import EXTRA_VIDEO_TYPES

    assert OPT_IN_TYPES == tuple(sorted(EXTRA_VIDEO_TYPES))


def test_the_real_module_runs_the_command():
    """A command runs the function of the module as imported normally (patches and module state apply)."""
    from keye import cli

    args = build_parser().parse_args(["data", "check", "x.jsonl"])
    real = cli._runnable(args.func)
    import keye.data.cli as data_cli

    assert real is data_cli._check
