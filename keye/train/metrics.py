"""Where a run's metrics go: ``metrics.jsonl`` (always) and TensorBoard (optional) on the main rank
(:class:`MetricsWriter`), and :class:`RunLog`, the per-step log with its progress bar both recipes use."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


class MetricsWriter:
    """JSONL metrics (always) and TensorBoard scalars (when installed and enabled); rank 0 only."""

    def __init__(self, out_dir: Path, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self.file = None
        self.tb = None
        if not enabled:
            return
        self.file = open(out_dir / "metrics.jsonl", "a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out_dir / "tensorboard"))
            except Exception:  # noqa: BLE001 - tensorboard is optional
                self.tb = None

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Append ``{"step": step, **metrics}`` (and the numeric values to TensorBoard)."""
        if not self.enabled:
            return
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        """Close the files (idempotent)."""
        if self.file:
            self.file.close()
            self.file = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep only the rows of ``path`` with ``step <= last_step``: after a resume from step ``last_step``, rows
    written later belong to steps that were lost and are about to run again."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in keep))


class RunLog:
    """A run's step log: rows to ``metrics.jsonl`` (+ TensorBoard) every ``log.every`` steps and a progress bar
    (``log.progress``), both on the main rank only; other ranks write nothing.

    Args:
        log: the ``log`` section (:class:`keye.train.sections.LogSection`).
        out_dir: the run directory.
        is_main: whether this is the main rank.
        total: steps of the whole run (the bar's length).
        start_step: the step the run resumes after (0 for a fresh run); rows of later steps are dropped.
        desc: the bar's label.
        postfix: the bar's figures from a step row (default: none).
    """

    def __init__(self, log: Any, out_dir: Path, is_main: bool, *, total: int, start_step: int, desc: str,
                 postfix: Callable[[dict[str, Any]], dict[str, str]] | None = None):
        self.every, self.postfix = log.every, postfix
        if is_main and start_step:
            truncate_jsonl(out_dir / "metrics.jsonl", start_step)
        self.metrics = MetricsWriter(out_dir, is_main, log.tensorboard)
        self.bar = None
        if is_main and log.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=start_step, desc=desc, dynamic_ncols=True)

    def write(self, step: int, values: dict[str, Any]) -> None:
        """Write ``values`` as a row of ``step`` now (evaluation results)."""
        self.metrics.write(step, values)

    def step(self, step: int, row: dict[str, Any]) -> None:
        """Log a finished step: its row (when ``step`` is a multiple of ``log.every``) and the bar."""
        if step % self.every == 0:
            self.metrics.write(step, row)
        if self.bar is not None:
            if self.postfix is not None:
                self.bar.set_postfix(**self.postfix(row))
            self.bar.update(1)

    def close_progress(self) -> None:
        """Close the progress bar (the training loop is over)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self) -> None:
        """Close the bar and the metrics files."""
        self.close_progress()
        self.metrics.close()


__all__ = ["MetricsWriter", "RunLog", "truncate_jsonl"]
