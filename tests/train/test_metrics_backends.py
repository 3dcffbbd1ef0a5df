"""Logging backends of a run (``log.backends``): W&B offline and MLflow's local file store, with no account and
no network; a backend whose package is missing is a one-line error naming it; ``log.tensorboard`` still works."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

import pytest

from keye.errors import KeyeConfigError
from keye.train.config import load_config
from keye.train.metrics import RunLog, resolve_backends
from keye.train.sections import LogSection

ROWS = [(1, {"loss": 2.5, "lr": 1e-4, "mode": "sft"}), (2, {"loss": 2.0, "lr": 1e-4, "acc@8": 0.5})]


def _log(tmp_path, log, *, start_step=0, rows=ROWS):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.yaml").write_text("train:\n  lr: 0.0001\nlog:\n  every: 1\n")
    run = RunLog(log, tmp_path, True, total=2, start_step=start_step, desc="test")
    for step, row in rows:
        run.step(step, row)
    run.close()
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@dataclass
class Cfg:
    log: LogSection = field(default_factory=LogSection)


def test_backends_parse_from_yaml_and_overrides():
    assert load_config(Cfg, None, ["log.backends=[wandb,mlflow,wandb]"]).log.backends == ["wandb", "mlflow"]
    assert load_config(Cfg, None, ["log.backends=mlflow"]).log.backends == ["mlflow"]
    assert load_config(Cfg, None, []).log.backends is None
    with pytest.raises(KeyeConfigError, match="log.backends: 'neptune' is not one of tensorboard, wandb, mlflow"):
        load_config(Cfg, None, ["log.backends=[neptune]"])
    with pytest.raises(KeyeConfigError, match="wandb_mode"):
        load_config(Cfg, None, ["log.wandb_mode=sometimes"])


@pytest.mark.parametrize("backend, package, requirement", [
    ("wandb", "wandb", "wandb"), ("mlflow", "mlflow", "mlflow-skinny"), ("tensorboard", "tensorboard", "tensorboard"),
])
def test_a_selected_backend_that_is_not_installed_is_an_error_naming_it(backend, package, requirement, monkeypatch,
                                                                        tmp_path):
    monkeypatch.setitem(sys.modules, package, None)  # as if it were not installed
    with pytest.raises(KeyeConfigError) as info:
        RunLog(LogSection(backends=[backend], progress=False), tmp_path, True, total=1, start_step=0, desc="x")
    assert str(info.value) == (f"log.backends: {backend} needs the {package!r} package, which is not installed; "
                               f"pip install {requirement} (or remove {backend} from log.backends)")
    # every rank stops, not only the main one (a rank left running would wait for the others forever)
    with pytest.raises(KeyeConfigError):
        RunLog(LogSection(backends=[backend], progress=False), tmp_path, False, total=1, start_step=0, desc="x")
    assert not (tmp_path / "metrics.jsonl").exists()


def test_the_older_tensorboard_switch_still_decides_when_backends_is_unset(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    assert resolve_backends(LogSection(tensorboard=True)) == []  # not installed: skipped, as before
    assert resolve_backends(LogSection(tensorboard=False, backends=[])) == []
    monkeypatch.setattr("keye.train.metrics._installed", lambda module: True)
    assert resolve_backends(LogSection(tensorboard=True)) == ["tensorboard"]
    assert resolve_backends(LogSection(tensorboard=False)) == []
    assert resolve_backends(LogSection(tensorboard=False, backends=["tensorboard"])) == ["tensorboard"]


def test_metrics_jsonl_alone_without_backends(tmp_path):
    rows = _log(tmp_path, LogSection(progress=False, tensorboard=False))
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["mode"] == "sft"


def test_mlflow_logs_to_a_file_store_under_the_run(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="mlflow-skinny is not installed (pip install 'keye[train]')")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "unset")  # recorded, so the test leaves it as it was
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    run_dir = tmp_path / "run"
    _log(run_dir, LogSection(progress=False, backends=["mlflow"], project="keye-test"))
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"  # MLflow 3 refuses its file store without it
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["train.lr"] == "0.0001"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(1, 2.5), (2, 2.0)]
    assert [m.value for m in client.get_metric_history(run_id, "acc_8")] == [0.5]  # '@' is not allowed by MLflow
    # a resumed run (same directory) continues the same MLflow run
    _log(run_dir, LogSection(progress=False, backends=["mlflow"], project="keye-test"), start_step=2,
         rows=[(3, {"loss": 1.5})])
    assert (run_dir / "mlflow_run_id").read_text().strip() == run_id
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2, 3]
    assert client.get_run(run_id).info.status == "FINISHED"


def _wandb_history(path) -> list[dict]:
    """The history rows of an offline W&B run file (``run-<id>.wandb``: LevelDB log records of 32 KiB blocks,
    each a ``wandb_internal_pb2.Record``), read without wandb's service or an account."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, rows, chunks = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left
            continue
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_wandb_offline_needs_no_account(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'keye[train]')")
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))  # no ~/.config/wandb, no login
    run_dir = tmp_path / "run"
    _log(run_dir, LogSection(progress=False, backends=["wandb"], wandb_mode="offline", project="keye-test"))
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    offline = list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(offline) == 1, list((run_dir / "wandb").iterdir())
    rows = _wandb_history(offline[0] / f"run-{run_id}.wandb")
    assert [(r["_step"], r["loss"]) for r in rows] == [(1, 2.5), (2, 2.0)]
    assert "mode" not in rows[0] and rows[1]["acc@8"] == 0.5  # numbers only; W&B takes '@' in names
