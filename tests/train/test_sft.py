"""SFT recipe: config handling, a short real run, exact resume, distributed parity, DeepSpeed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from keye import KeyeProcessor, KeyeVL
from keye.errors import KeyeConfigError
from keye.recipes.sft import train
from keye.sft.config import SFTConfig
from keye.train.config import dump_config, load_config
from keye.train.optim import lr_lambda
from tests.conftest import TORCH_THREADS
from tests.torchrun import job_args, torchrun

REPO = Path(__file__).resolve().parents[2]


def _cfg(tiny_ckpt, synth_set, out, *extra):
    return load_config(SFTConfig, None, [
        f"model.path={tiny_ckpt}", f"data.manifest={synth_set['train']}", "data.batch_tokens=1536",
        "train.lr=3e-3", "train.warmup_steps=1", f"checkpoint.out_dir={out}", "log.progress=false",
        "log.tensorboard=false", *extra,
    ])


def test_config_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 1e-4\n  stage: align\ndata:\n  micro_batches: 2\n")
    cfg = load_config(SFTConfig, path, ["train.lr=5e-5", "lora.targets=[llm, vision]", "data.root=null"])
    assert cfg.train.lr == 5e-5 and cfg.train.stage == "align" and cfg.data.micro_batches == 2
    assert cfg.lora.targets == ["llm", "vision"] and cfg.data.root is None
    dump_config(cfg, tmp_path / "out.yaml")
    assert load_config(SFTConfig, tmp_path / "out.yaml") == cfg
    path.write_text("train:\n  lrr: 1\n")
    with pytest.raises(KeyeConfigError, match=r"c\.yaml\.train: unknown key\(s\) \['lrr'\]"):
        load_config(SFTConfig, path)
    with pytest.raises(KeyeConfigError, match="config.train.stage"):
        load_config(SFTConfig, None, ["train.stage=everything"])
    with pytest.raises(KeyeConfigError, match="expected an integer"):
        load_config(SFTConfig, None, ["train.epochs=two"])


def test_lr_schedule_warmup_then_cosine():
    cfg = SFTConfig().train
    cfg.warmup_steps, cfg.min_lr_ratio = 2, 0.1
    f = lr_lambda(cfg, 12)
    assert [round(f(s), 4) for s in (0, 1)] == [0.5, 1.0]
    assert f(2) == pytest.approx(1.0) and f(12) == pytest.approx(0.1) and f(7) == pytest.approx(0.55)


@pytest.mark.slow
def test_short_run_learns_exports_and_generates(tiny_ckpt, synth_set, tmp_path):
    cfg = _cfg(tiny_ckpt, synth_set, tmp_path / "run", "train.max_steps=10", "train.stage=full")
    summary = train(cfg)
    losses = summary["losses"]
    assert summary["finished"] and summary["steps"] == 10 and summary["skipped_samples"] == 0
    assert sum(losses[-3:]) / 3 < losses[0] * 0.8, losses
    run = tmp_path / "run"
    assert (run / "config.yaml").is_file() and (run / "summary.json").is_file()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11)) and all(r["tokens_per_s"] > 0 for r in rows)
    model = KeyeVL.from_pretrained(run / "final")
    proc = KeyeProcessor.from_pretrained(run / "final")
    row = json.loads(synth_set["test"].read_text().splitlines()[0])
    msgs = [m for m in row["messages"] if m["role"] == "user"]
    for item in msgs[0]["content"]:
        if item["type"] in ("video", "image"):
            item[item["type"]] = str(synth_set["test"].parent / item[item["type"]])
    batch = proc([msgs])
    out = model.generate(**batch, max_new_tokens=4)
    assert out.shape[1] > batch["input_ids"].shape[1]


@pytest.mark.slow
def test_kill_and_resume_equals_uninterrupted(tiny_ckpt, synth_set, tmp_path):
    args = ("train.max_steps=6", "checkpoint.save_every=2", "checkpoint.keep_last=1")
    full = train(_cfg(tiny_ckpt, synth_set, tmp_path / "a", *args))
    part = train(_cfg(tiny_ckpt, synth_set, tmp_path / "b", *args), stop_after=3)  # "crash" after step 3
    assert not part["finished"] and part["steps"] == 3
    assert [p.name for p in sorted((tmp_path / "b").glob("step_*"))] == ["step_00000002"]
    resumed = train(_cfg(tiny_ckpt, synth_set, tmp_path / "b", *args))
    assert resumed["finished"] and resumed["losses"] == full["losses"]
    a = KeyeVL.from_pretrained(tmp_path / "a/final").state_dict()
    b = KeyeVL.from_pretrained(tmp_path / "b/final").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_align_stage_freezes_towers(tiny_ckpt, synth_set, tmp_path):
    summary = train(_cfg(tiny_ckpt, synth_set, tmp_path / "align", "train.max_steps=1", "train.stage=align"))
    assert summary["frozen_towers"] == ["vision", "llm"]
    before = KeyeVL.from_pretrained(tiny_ckpt).state_dict()
    after = KeyeVL.from_pretrained(tmp_path / "align/final").state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("mlp_AR.") for k in changed)


def test_preprocessor_override_trains_at_the_new_budget_and_is_exported(tiny_ckpt, synth_set, tmp_path):
    base = json.loads((Path(tiny_ckpt) / "preprocessor_config.json").read_text())
    small = max(base["min_pixels"], 28 * 28 * 4)
    yaml = tmp_path / "c.yaml"
    yaml.write_text(f"model:\n  preprocessor:\n    max_pixels: {small}\n    video_defaults:\n      max_pixels: {small}\n      floor_pixels: {small}\n")
    args = (f"model.path={tiny_ckpt}", f"data.manifest={synth_set['train']}", "data.batch_tokens=1536",
            "train.max_steps=1", "log.progress=false", "log.tensorboard=false")
    cfg = load_config(SFTConfig, yaml, [*args, f"checkpoint.out_dir={tmp_path / 'small'}"])
    small_run = train(cfg)
    plain_run = train(load_config(SFTConfig, None, [*args, f"checkpoint.out_dir={tmp_path / 'plain'}"]))
    saved = json.loads((tmp_path / "small/final/preprocessor_config.json").read_text())
    assert saved["max_pixels"] == small and saved["video_defaults"]["max_pixels"] == small
    assert json.loads((tmp_path / "plain/final/preprocessor_config.json").read_text())["max_pixels"] == base["max_pixels"]
    # fewer vision tokens per sample (so the packed micro-batch holds more samples)
    per_sample = [r["tokens"] / r["samples"] for r in (small_run, plain_run)]
    assert per_sample[0] < 0.8 * per_sample[1], per_sample
    bad = load_config(SFTConfig, None, [*args, f"checkpoint.out_dir={tmp_path / 'bad'}"])
    bad.model.preprocessor = {"max_pixel": 1}
    with pytest.raises(KeyeConfigError, match="model.preprocessor: unknown preprocessor field"):
        train(bad)


@pytest.mark.slow
def test_lora_run_exports_merged_official_layout(tiny_ckpt, synth_set, tmp_path):
    summary = train(_cfg(tiny_ckpt, synth_set, tmp_path / "lora", "train.max_steps=2", "lora.enabled=true",
                         "lora.targets=[llm]", "lora.r=4", "train.stage=llm_only"))
    assert summary["finished"]
    base = KeyeVL.from_pretrained(tiny_ckpt).state_dict()
    merged = KeyeVL.from_pretrained(tmp_path / "lora/final").state_dict()
    assert set(base) == set(merged)  # official names only, adapters folded in
    assert not torch.equal(base["model.layers.0.self_attn.q_proj.weight"], merged["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(base["visual.vision_model.encoder.layers.0.mlp.fc1.weight"],
                       merged["visual.vision_model.encoder.layers.0.mlp.fc1.weight"])


def _job(out, strategy, tiny_ckpt, synth_set, *extra) -> list[object]:
    """One job of ``_dist_sft.py``: the run :func:`_cfg` describes, under ``strategy``."""
    return [out, strategy, f"model.path={tiny_ckpt}", f"data.manifest={synth_set['train']}", "data.batch_tokens=1536",
            "train.lr=3e-3", "train.warmup_steps=1", "log.progress=false", "log.tensorboard=false",
            "train.device=cpu", *extra]


@pytest.fixture(scope="module")
def two_procs(tiny_ckpt, synth_set, tmp_path_factory) -> Path:
    """The module's 2-process runs (DDP, FSDP2, then DeepSpeed ZeRO-2) as the jobs of ONE torchrun launch of
    ``_dist_sft.py``: a launch costs seconds of imports whatever it runs; every job writes its own folder and
    train() seeds each run's random state."""
    root = tmp_path_factory.mktemp("two_procs")
    jobs = [_job(root / s, s, tiny_ckpt, synth_set, "train.max_steps=4", "data.micro_batches=1")
            for s in ("ddp", "fsdp2")]
    jobs.append(_job(root / "ds", "zero2", tiny_ckpt, synth_set, "train.max_steps=3",
                     f"train.deepspeed_config={REPO / 'training/deepspeed/zero2.json'}"))
    torchrun(job_args(REPO / "tests/train/_dist_sft.py", jobs), nproc=2, env={"KEYE_LOG_LEVEL": "WARNING"}, timeout=900)
    return root


@pytest.fixture(scope="module")
def one_proc(tiny_ckpt, synth_set, tmp_path_factory) -> tuple[dict, Path]:
    """The one-process run both 2-process layouts are compared with (the same global batch)."""
    out = tmp_path_factory.mktemp("one_proc") / "one"
    torch.set_num_threads(TORCH_THREADS)  # as inside a test (a module fixture runs before the per-test setting)
    return train(_cfg(tiny_ckpt, synth_set, out, "train.max_steps=4", "data.micro_batches=2")), out


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_process_run_matches_one_process(strategy, one_proc, two_procs):
    one, one_dir = one_proc
    two = _summary(two_procs / strategy)
    assert two["world_size"] == 2 and two["strategy"] == strategy
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-4, abs=1e-5)
    # The logged gradient norm is the global one (FSDP2: over all shards), as the single process sees it.
    norms = [[json.loads(x)["grad_norm"] for x in (d / "metrics.jsonl").read_text().splitlines()]
             for d in (one_dir, two_procs / strategy)]
    assert norms[1] == pytest.approx(norms[0], rel=1e-4)


@pytest.mark.slow
def test_deepspeed_zero2_runs_on_cpu(two_procs):
    two = _summary(two_procs / "ds")
    assert two["steps"] == 3 and two["strategy"] == "zero2"
    assert all(x == x and x < 20 for x in two["losses"])
