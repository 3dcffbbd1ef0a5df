"""Render the demo's bundled example clips into demo/examples/ (held-out synthetic test samples).

.venv/bin/python demo/make_examples.py
"""

from __future__ import annotations

from pathlib import Path

from keye.demo.examples import write_examples

if __name__ == "__main__":
    out = Path(__file__).resolve().parent / "examples"
    for row in write_examples(out):
        print(f"{row['video']:>18}  {row['id']}  {row['question']!r} -> {row['answer']}")
