"""Evaluate a model on synth (thin script over ``keye eval synth``; see keye/eval/cli.py for the options).

Usage: python eval/synth.py --model PATH --out runs/synth [...]
"""

from __future__ import annotations

import sys

from keye.eval.cli import script_main

if __name__ == "__main__":
    sys.exit(script_main("synth"))
