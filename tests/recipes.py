"""What the recipe tests share: the small RL sets built from the synthetic set, and the configs of the runs
(fixtures of the same names live in tests/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

from keye.rl import ReplayEntry, ReplayPool
from keye.rl.config import RLEPConfig
from keye.train.config import load_config

# AutoThink runs: fresh answers per group, forced-think and forced-direct answers per question, replayed answers
# per group, answer budget
AT_G, AT_THINK_N, AT_DIRECT_N, AT_M, AT_MAX_NEW = 2, 2, 3, 2, 32


def cheapest_rows(manifest: Path, k: int) -> list[dict]:
    """The ``k`` rows of a synthetic manifest with the fewest video pixels (the fastest to process)."""
    rows = [json.loads(x) for x in manifest.read_text().splitlines()]
    return sorted(rows, key=lambda r: r["meta"]["num_frames"] * r["meta"]["width"] * r["meta"]["height"])[:k]


def make_rl_set(synth_set: dict[str, Path]) -> dict[str, Path]:
    """The 4 cheapest training questions as an RL manifest, the first 3 test questions, and a replay pool holding
    two reference answers per question (synthetic verified successes: a random model almost never answers
    correctly, so phase B is tested with answers we know are right)."""
    small = cheapest_rows(synth_set["train"], 4)
    root = synth_set["train"].parent
    train_path = root / "rl_train.jsonl"
    train_path.write_text("".join(json.dumps(r) + "\n" for r in small))
    test_path = root / "rl_test.jsonl"
    test_path.write_text("".join(x + "\n" for x in synth_set["test"].read_text().splitlines()[:3]))
    pool = ReplayPool()
    for r in small:
        pool.add(ReplayEntry(r["id"], r["answer"], None, 1.0, {"source": "reference"}))
        pool.add(ReplayEntry(r["id"], f"Answer: {r['answer']}", None, 1.0, {"source": "reference"}))
    return {"train": train_path, "test": test_path, "pool": pool.save_jsonl(root / "rl_pool.jsonl")}


def make_at_set(synth_set: dict[str, Path]) -> dict[str, Path]:
    """The 4 cheapest training questions and a pool of two verified answers per question and mode: a well-formed
    auto reply that answers directly and one that thinks, a /think and a /no_think answer. A random tiny model
    almost never answers correctly or in form, so the replayed rows are what makes the bonus and the length
    penalty appear in the auto groups."""
    small = cheapest_rows(synth_set["train"], 4)
    root = synth_set["train"].parent
    train_path = root / "at_train.jsonl"
    train_path.write_text("".join(json.dumps(r) + "\n" for r in small))
    pool = ReplayPool()
    for r in small:
        a = r["answer"]
        for text, mode in ((f"<analysis>Easy. /no_think</analysis>{a}", "auto"),
                           (f"<analysis>Hard. /think</analysis><think>count them</think>{a}", "auto"),
                           (f"<think>count them</think>{a}", "think"), (f"<think>look</think>{a}", "think"),
                           (str(a), "no_think"), (f"Answer: {a}", "no_think")):
            pool.add(ReplayEntry(r["id"], text, None, 1.0, {"mode": mode, "source": "reference"}))
    return {"train": train_path, "pool": pool.save_jsonl(root / "at_pool.jsonl")}


def rl_overrides(tiny_ckpt: Path, rl_set: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """The dot-list overrides of a two-prompt, G=2, M=2 RLEP run of the tiny checkpoint on ``rl_set`` into ``out``
    (CPU, quiet), then ``extra``."""
    return [f"model.path={tiny_ckpt}", f"data.manifest={rl_set['train']}", "data.prompts_per_step=2", "rollout.G=2",
            "rollout.max_new_tokens=4", f"replay.pool={rl_set['pool']}", "replay.M=2", "train.lr=1e-3",
            "algorithm.micro_batch_size=3", f"checkpoint.out_dir={out}", "log.progress=false", "log.tensorboard=false",
            "train.device=cpu", *extra]


def rl_config(tiny_ckpt: Path, rl_set: dict[str, Path], out: Path, *extra: str) -> RLEPConfig:
    """The config of :func:`rl_overrides`."""
    return load_config(RLEPConfig, None, rl_overrides(tiny_ckpt, rl_set, out, *extra))


def at_config(tiny_ckpt: Path, at_set: dict[str, Path], out: Path, *extra: str) -> RLEPConfig:
    """An AutoThink run of the tiny checkpoint on ``at_set`` into ``out`` (the AT_* sizes), plus ``extra``."""
    return load_config(RLEPConfig, None, [
        f"model.path={tiny_ckpt}", f"data.manifest={at_set['train']}", "data.prompts_per_step=2", f"rollout.G={AT_G}",
        f"rollout.max_new_tokens={AT_MAX_NEW}", f"replay.pool={at_set['pool']}", f"replay.M={AT_M}", "train.lr=1e-3",
        "algorithm.micro_batch_size=4", f"checkpoint.out_dir={out}", "log.progress=false", "train.device=cpu",
        "algorithm.autothink.enabled=true", f"algorithm.autothink.think_samples={AT_THINK_N}",
        f"algorithm.autothink.direct_samples={AT_DIRECT_N}", *extra,
    ])
