"""Evaluate a model on videoqa (thin script over ``keye eval videoqa``; see keye/eval/cli.py for the options).

Usage: python eval/video_qa.py --model PATH --out runs/videoqa [...]
"""

from __future__ import annotations

import sys

from keye.eval.cli import script_main

if __name__ == "__main__":
    sys.exit(script_main("videoqa"))
