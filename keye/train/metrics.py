"""Where a run's metrics go: ``metrics.jsonl`` (always) and TensorBoard (optional), on the main rank."""

from __future__ import annotations

import json
from pathlib import Path


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
        if not self.enabled:
            return
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
