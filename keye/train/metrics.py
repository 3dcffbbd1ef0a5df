"""Where a run's metrics go, on the main rank: ``metrics.jsonl`` (always) and the logging backends of
``log.backends`` (TensorBoard, Weights & Biases, MLflow; :class:`MetricsWriter`), and :class:`RunLog`, the
per-step log with its progress bar both recipes use.

Each backend is an optional package. Selecting one that is not installed is a :class:`KeyeConfigError` naming
the package, raised on every rank before the run starts (so no rank is left waiting for another that
stopped). None of them needs an account or a network: ``log.wandb_mode=offline`` writes the W&B run under
``<run>/wandb`` (``wandb sync`` uploads it later), and MLflow logs to a file store under ``<run>/mlruns``
unless ``log.mlflow_tracking_uri`` or ``MLFLOW_TRACKING_URI`` names a server (MLflow 3 refuses file stores
unless ``MLFLOW_ALLOW_FILE_STORE=true``, which keye sets for that default store). A resumed run (same run
directory) continues the same W&B and MLflow runs: their ids are kept in ``<run>/wandb_run_id`` and
``<run>/mlflow_run_id``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from keye.errors import KeyeConfigError

# backend -> (the module it imports, the pip requirement that provides it)
PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow-skinny"),
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails to import, or a module set to None
        return False


def resolve_backends(log: Any) -> list[str]:
    """The backends a ``log`` section (:class:`keye.train.sections.LogSection`) asks for, checked.

    ``log.backends`` when set: every one must be installed, else :class:`KeyeConfigError` names the missing
    package and how to install it. When it is not set, the older switch ``log.tensorboard`` decides:
    TensorBoard when it is true and installed (skipped silently otherwise, as before backends existed).
    """
    chosen = getattr(log, "backends", None)
    if chosen is None:
        return ["tensorboard"] if getattr(log, "tensorboard", False) and _installed("tensorboard") else []
    for name in chosen:
        if name not in PACKAGES:
            raise KeyeConfigError(f"log.backends: {name!r} is not one of {', '.join(PACKAGES)}")
        module, requirement = PACKAGES[name]
        if not _installed(module):
            raise KeyeConfigError(
                f"log.backends: {name} needs the {module!r} package, which is not installed; "
                f"pip install {requirement} (or remove {name} from log.backends)"
            )
    return list(chosen)


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    # Rows also carry strings and lists (modes, histograms): the backends take numbers only.
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


def _run_config(out_dir: Path) -> dict[str, Any]:
    """The run's resolved ``config.yaml`` (written by :mod:`keye.train.run`), or {} when there is none."""
    path = out_dir / "config.yaml"
    if not path.is_file():
        return {}
    import yaml

    config = yaml.safe_load(path.read_text())
    return config if isinstance(config, dict) else {}


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys (``{"train": {"lr": 1e-4}}`` -> ``{"train.lr": 1e-4}``)."""
    if not isinstance(node, dict):
        return {prefix: node}
    flat: dict[str, Any] = {}
    for k, v in node.items():
        flat.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return flat


def _run_id(out_dir: Path, name: str, new: Callable[[], str]) -> tuple[str, bool]:
    """``(id, resumed)``: the id kept in ``out_dir/name`` by an earlier start of this run, else a new one (kept)."""
    path = out_dir / name
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip(), True
    run_id = new()
    path.write_text(run_id + "\n")
    return run_id, False


class _TensorBoard:
    def __init__(self, out_dir: Path, log: Any):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out_dir / "tensorboard"))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, out_dir: Path, log: Any):
        import wandb

        self.wandb = wandb
        # W&B run ids are short [a-z0-9] strings; ours is kept in the run directory so a resume continues it
        run_id, _ = _run_id(out_dir, "wandb_run_id", lambda: uuid.uuid4().hex[:8])
        mode = getattr(log, "wandb_mode", None) or os.environ.get("WANDB_MODE") or "online"
        try:
            self.run = wandb.init(
                project=log.project, entity=getattr(log, "wandb_entity", None),
                name=getattr(log, "run_name", None) or out_dir.resolve().name, id=run_id, resume="allow",
                dir=str(out_dir), mode=mode, config=_run_config(out_dir),
            )
        except Exception as err:  # noqa: BLE001 - wandb raises its own types (UsageError, CommError, ...)
            raise KeyeConfigError(
                f"log.backends: wandb could not start a run in {mode} mode ({type(err).__name__}: {err}); log in with "
                "`wandb login` (or set WANDB_API_KEY), or run without an account: log.wandb_mode=offline "
                f"(`wandb sync {out_dir}/wandb` uploads it later)"
            ) from err

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


# MLflow accepts letters, digits and _ - . space : / in metric and parameter names.
_MLFLOW_NAME = re.compile(r"[^\w\-. :/]")


class _MLflow:
    BATCH = 100  # MLflow's limit on params / metrics per log_batch call

    def __init__(self, out_dir: Path, log: Any):
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.Metric = Metric
        uri = getattr(log, "mlflow_tracking_uri", None) or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (out_dir / "mlruns").resolve().as_uri()
            # MLflow 3 keeps its file store in "maintenance mode" and refuses it unless this opt-out is set; a
            # file store is what needs no server and no database driver (mlflow-skinny has none), so keye's
            # default sets it (`MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri <run>/mlruns` shows it).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            self.client = MlflowClient(tracking_uri=uri)
            experiment = self.client.get_experiment_by_name(log.project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(log.project)
            name = getattr(log, "run_name", None) or out_dir.resolve().name
            self.run_id, resumed = _run_id(
                out_dir, "mlflow_run_id",
                lambda: self.client.create_run(experiment_id, run_name=name).info.run_id)
            if resumed:
                self.client.update_run(self.run_id, status="RUNNING")
            else:
                params = [Param(_MLFLOW_NAME.sub("_", k)[:250], str(v)[:500])
                          for k, v in _flatten(_run_config(out_dir)).items()]
                for i in range(0, len(params), self.BATCH):
                    self.client.log_batch(self.run_id, params=params[i:i + self.BATCH])
        except Exception as err:  # noqa: BLE001 - MlflowException, connection errors, ...
            raise KeyeConfigError(
                f"log.backends: mlflow could not start a run at {uri} ({type(err).__name__}: {err})"
            ) from err

    def write(self, step: int, scalars: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self.Metric(_MLFLOW_NAME.sub("_", k), v, now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), self.BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + self.BATCH])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


_BACKENDS = {"tensorboard": _TensorBoard, "wandb": _Wandb, "mlflow": _MLflow}


class MetricsWriter:
    """JSONL metrics (always) and the chosen logging backends; rank 0 only (``enabled``).

    ``backends``: names from :data:`PACKAGES`, already checked (:func:`resolve_backends`); the older
    ``tensorboard=True`` alone means TensorBoard when installed. ``log`` is the ``log`` section the backends
    read their settings from (project, run name, W&B mode, MLflow URI); None uses the defaults.
    """

    def __init__(self, out_dir: Path, enabled: bool, tensorboard: bool = False, *,
                 backends: list[str] | None = None, log: Any = None):
        self.enabled = enabled
        self.file = None
        self.backends: dict[str, Any] = {}
        if not enabled:
            return
        if backends is None:
            backends = ["tensorboard"] if tensorboard and _installed("tensorboard") else []
        if log is None:
            from keye.train.sections import LogSection

            log = LogSection()
        out_dir = Path(out_dir)
        self.file = open(out_dir / "metrics.jsonl", "a")
        try:
            for name in backends:
                self.backends[name] = _BACKENDS[name](out_dir, log)
        except BaseException:
            self.close()
            raise

    @property
    def tb(self) -> Any:
        """The TensorBoard ``SummaryWriter``, or None (kept for code that used it directly)."""
        board = self.backends.get("tensorboard")
        return board.writer if board is not None else None

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Append ``{"step": step, **metrics}`` to ``metrics.jsonl``; the numeric values also go to every backend."""
        if not self.enabled:
            return
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        if self.backends:
            scalars = _scalars(metrics)
            for backend in self.backends.values():
                backend.write(step, scalars)

    def close(self) -> None:
        """Close the file and finish the backends' runs (idempotent)."""
        if self.file:
            self.file.close()
            self.file = None
        backends, self.backends = self.backends, {}
        for backend in backends.values():
            backend.close()


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep only the rows of ``path`` with ``step <= last_step``: after a resume from step ``last_step``, rows
    written later belong to steps that were lost and are about to run again."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in keep))


class RunLog:
    """A run's step log: rows to ``metrics.jsonl`` and the ``log.backends`` every ``log.every`` steps and a
    progress bar (``log.progress``), both on the main rank only; other ranks write nothing.

    Every rank checks the backends first (:func:`resolve_backends`), so a missing package stops all ranks
    with the same one-line error.

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
        backends = resolve_backends(log)
        if is_main and start_step:
            truncate_jsonl(out_dir / "metrics.jsonl", start_step)
        self.metrics = MetricsWriter(out_dir, is_main, backends=backends, log=log)
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
        """Close the bar, the metrics file and the backends' runs."""
        self.close_progress()
        self.metrics.close()


__all__ = ["PACKAGES", "MetricsWriter", "RunLog", "resolve_backends", "truncate_jsonl"]
