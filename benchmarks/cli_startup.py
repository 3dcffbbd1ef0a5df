"""How fast the ``keye`` command answers: wall time of ``keye --help`` and ``keye chat --help``, each the median
of 5 fresh processes, against ``python -c "import transformers"`` (what the command line used to import before
answering) measured the same way in the same run, so the ratio holds on a loaded machine too. One more run of
each command under ``python -X importtime`` lists any torch / transformers import (there should be none).

The last line: ``cli startup: keye --help X.XX s, keye chat --help Y.YY s (median of 5; target < 0.5 s);
import transformers Z.ZZ s: N.Nx faster``.

Usage: python benchmarks/cli_startup.py [--repeats 5] [--quick]   (``--quick``: one run of each command)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HEAVY = ("torch", "transformers")
TARGET_S = 0.5


def _keye() -> list[str]:
    """The installed ``keye`` script next to this interpreter, else ``python -m keye`` (same code path)."""
    script = Path(sys.executable).with_name("keye")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "keye"]


def median_seconds(cmd: list[str], repeats: int) -> float:
    """Median wall time of ``repeats`` runs of ``cmd`` (output discarded); raises if a run fails."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def heavy_imports(args: list[str]) -> list[str]:
    """Top-level packages of :data:`HEAVY` that ``keye ARGS`` imports, from ``python -X importtime``."""
    code = f"import sys; from keye.cli import main; sys.argv = ['keye', *{args!r}]; sys.exit(main())"
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    found = set()
    for line in out.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip().split(".")[0]
            if name in HEAVY:
                found.add(name)
    return sorted(found)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark with the command line ``argv`` (``None``: ``sys.argv[1:]``); the last line is the
    documented ``cli startup: ...`` line."""
    from _quick import parse_args

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per command (median; default: 5)")
    args = parse_args(parser, argv, {"repeats": 1})
    keye = _keye()
    commands = {"keye --help": [*keye, "--help"], "keye chat --help": [*keye, "chat", "--help"]}
    subprocess.run(commands["keye --help"], check=True, stdout=subprocess.DEVNULL)  # warm the file cache
    results = {name: median_seconds(cmd, args.repeats) for name, cmd in commands.items()}
    baseline = median_seconds([sys.executable, "-c", "import transformers"], args.repeats)
    for name, seconds in results.items():
        heavy = heavy_imports(commands[name][len(keye):])
        verdict = "ok" if seconds < TARGET_S else f"over the {TARGET_S} s target"
        print(f"{name:18s} {seconds:6.3f} s  ({verdict}; imports {', '.join(heavy) if heavy else 'no torch, no transformers'})")
    print(f"{'import transformers':18s} {baseline:6.3f} s  (the baseline, same run)")
    slowest = max(results.values())
    print(f"cli startup: keye --help {results['keye --help']:.2f} s, keye chat --help {results['keye chat --help']:.2f} s "
          f"(median of {args.repeats}; target < {TARGET_S} s); import transformers {baseline:.2f} s: "
          f"{baseline / slowest:.1f}x faster")


if __name__ == "__main__":
    main()
