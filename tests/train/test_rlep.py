"""RLEP recipe: config checks, prompt stream, tree update == padded update, short real runs (replay,
metrics, eval curve), tree on == off (kill-and-resume: tests/rl/test_resume.py), 2-process data parallelism, ``keye rlep collect``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from keye import KeyeVL
from keye.errors import KeyeConfigError
from keye.recipes.rlep import train
from keye.rl import (
    LocalRollout,
    ReplayEntry,
    ReplayPool,
    accumulate_policy_gradients,
    add_replay,
    assign_advantages,
    fill_logprobs,
    load_rl_prompts,
)
from keye.rl.config import RLEPConfig, tree_enabled, validate
from keye.rl.loop.state import PromptStream
from keye.rl.rollout.settings import SamplingSettings
from keye.train import dist as kdist
from keye.train.config import load_config
from tests.recipes import rl_config
from tests.torchrun import torchrun

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------ fast
def test_configs_load_and_validate(tmp_path):
    for name, world in (("tiny_synth_rlep", 1), ("tiny_synth_grpo", 1), ("keye_vl_8b_rlep", 8)):
        cfg = load_config(RLEPConfig, REPO / "training/configs" / f"{name}.yaml")
        validate(cfg, world)
    rlep = load_config(RLEPConfig, REPO / "training/configs/tiny_synth_rlep.yaml")
    grpo = load_config(RLEPConfig, REPO / "training/configs/tiny_synth_grpo.yaml")
    # the baseline differs from RLEP only by the replay switch (and where it writes)
    assert rlep.replay.enabled and not grpo.replay.enabled
    grpo.replay.enabled, grpo.replay.pool, grpo.checkpoint.out_dir = True, rlep.replay.pool, rlep.checkpoint.out_dir
    assert grpo == rlep
    assert rlep.eval.manifest == "data/synth/test.jsonl" and rlep.eval.limit == 500 and rlep.eval.every > 0
    assert rlep.eval.samples == 4 and rlep.algorithm.kl_coef > 0 and rlep.algorithm.reference
    # RL on keye-tiny keeps its tower frozen, as SFT does (trained end to end, GRPO wore down its shape probe)
    assert rlep.train.stage == "llm_only" and rlep.train.lr_projector < rlep.train.lr

    with pytest.raises(KeyeConfigError, match="kl_coef > 0 needs algorithm.reference"):
        validate(load_config(RLEPConfig, None, ["algorithm.kl_coef=0.1"]))
    with pytest.raises(KeyeConfigError, match="multiple of the world size"):
        validate(load_config(RLEPConfig, None, ["data.prompts_per_step=3"]), 2)
    with pytest.raises(KeyeConfigError, match="unknown difficulty preset"):
        validate(load_config(RLEPConfig, None, ["algorithm.difficulty=steep"]))
    with pytest.raises(KeyeConfigError, match="unknown thinking modes"):
        validate(load_config(RLEPConfig, None, ["algorithm.mode_mix={agentic: 1}"]))
    with pytest.raises(KeyeConfigError, match="config.train.strategy"):
        load_config(RLEPConfig, None, ["train.strategy=zero2"])


def test_tree_switch_defaults_to_groups_of_two_or_more():
    def on(*ov):
        return tree_enabled(load_config(RLEPConfig, None, list(ov)))

    assert on("rollout.G=8") and on("rollout.G=1", "replay.M=1")
    assert not on("rollout.G=1", "replay.M=0") and not on("rollout.G=1", "replay.M=2", "replay.enabled=false")
    assert not on("rollout.G=8", "tree.enabled=false") and on("rollout.G=1", "replay.M=0", "tree.enabled=true")


def test_prompt_stream_partitions_ranks_and_resumes():
    from keye.rl import RLPrompt

    prompts = [RLPrompt(str(i), [{"role": "user", "content": "q"}]) for i in range(10)]
    streams = [PromptStream(prompts, 3, r, 2, shuffle=True) for r in range(2)]
    first = [[p.id for p in s.draw(5)] for s in streams]
    assert sorted(first[0] + first[1]) == [str(i) for i in range(10)]  # one epoch = every prompt once
    assert first[0] != [str(i) for i in range(0, 10, 2)]  # shuffled
    s = streams[0]
    s.draw(2)
    saved = s.state_dict()
    cont = [p.id for p in s.draw(7)]  # crosses into epoch 2 and 3
    fresh = PromptStream(prompts, 3, 0, 2, shuffle=True)
    fresh.load_state_dict(saved)
    assert [p.id for p in fresh.draw(7)] == cont
    plain = PromptStream(prompts, 3, 1, 2, shuffle=False)
    assert [p.id for p in plain.draw(6)] == ["1", "3", "5", "7", "9", "1"]
    with pytest.raises(KeyeConfigError, match="cannot feed 4 ranks"):
        PromptStream(prompts[:3], 0, 0, 4, shuffle=False)


def test_tree_update_equals_padded_update(tiny_ckpt, rl_set, tmp_path):
    """The learner's tree passes give the core's old log-probs and exactly its gradients (mixed-sign
    advantages, replay rows, a missing replay slot, a response with a sampled vision placeholder id)."""
    from keye.processing.processor import KeyeProcessor
    from keye.rl.learner.learner import Learner

    torch.manual_seed(0)
    cfg = rl_config(tiny_ckpt, rl_set, tmp_path, "tree.groups_per_micro_batch=2", "algorithm.eps_low=0.2",
               "algorithm.eps_high=0.28", "algorithm.dual_clip=3.0", "algorithm.loss_agg=token-mean")
    learner = Learner.from_config(cfg, kdist.init_distributed("cpu"), model_path=tiny_ckpt)
    model = learner.model
    proc = KeyeProcessor.from_pretrained(tiny_ckpt)
    prompts = load_rl_prompts(rl_set["train"])[:2]
    engine = LocalRollout(model, proc, SamplingSettings(max_new_tokens=5), seed=1)
    fresh = engine.generate(prompts, 3)
    # group 1 gets a response with a stray <|video_pad|> id: that group takes the padded fallback path
    fresh[3].response_ids = torch.cat([fresh[3].response_ids[:2], torch.tensor([model.config.video_token_id])])
    pool = ReplayPool()
    pool.add(ReplayEntry(prompts[0].id, "A", [5, 6, int(model.config.eos_token_ids[0])]))
    samples = add_replay(fresh, pool, 2, encode=lambda t: [7] * len(t), eos_id=int(model.config.eos_token_ids[0]),
                         max_response_len=5)
    assert sum(not s.valid for s in samples) == 3  # 1 missing slot in group 0, 2 in group 1
    for i, s in enumerate(samples):
        s.reward, s.passed = float((i * 7) % 3), bool(i % 2)
    adv = assign_advantages(samples)
    assert (adv > 0).any() and (adv < 0).any()
    pad = int(proc.pad_token_id)
    fill_logprobs(model, samples, pad_id=pad)  # the core function is the reference
    ref_old = {id(s): s.old_logp.clone() for s in samples if s.valid}
    for s in samples:
        s.old_logp = None
    learner.compute_logprobs(samples, pad_id=pad, use_tree=True)
    for s in samples:
        if s.valid:
            torch.testing.assert_close(s.old_logp, ref_old[id(s)], atol=2e-5, rtol=0)
    # move the policy off the old one so clipping and dual clip are active
    with torch.no_grad():
        for s in samples:
            if s.valid:
                s.old_logp = s.old_logp + torch.linspace(-0.6, 0.6, s.num_tokens)
    kw = dict(eps_low=0.2, eps_high=0.28, dual_clip=3.0, loss_agg="token-mean")
    params = [p for p in model.parameters()]
    st_ref = accumulate_policy_gradients(model, samples, pad_id=pad, micro_batch_size=3, loss_kwargs=kw)
    g_ref = [None if p.grad is None else p.grad.clone() for p in params]
    for use_tree in (True, False):
        model.zero_grad(set_to_none=True)
        st = learner.accumulate(samples, pad_id=pad, use_tree=use_tree, loss_kwargs=kw)
        assert st["tokens"] == st_ref["tokens"] and st["sequences"] == st_ref["sequences"]
        assert st["loss"] == pytest.approx(st_ref["loss"], abs=1e-5)
        assert st_ref["clip_frac"] > 0 and st["clip_frac"] == pytest.approx(st_ref["clip_frac"])
        for p, g in zip(params, g_ref):
            if g is None:
                assert p.grad is None or not p.grad.abs().any()
            else:
                torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------ real runs
def test_dynamic_sampling_drops_groups_on_accuracy_by_default(tiny_ckpt, rl_set, tmp_path):
    """One real step of the recipe with dynamic sampling and the default signal: groups whose answers all fail (a
    random model) but differ in total reward (a length part that only some answers meet) carry no accuracy signal
    and are dropped (DAPO); with ``dynamic_sampling_metric=reward`` the same groups are kept - so the default, and
    the loop's use of it, are what decide."""
    extra = ("replay.enabled=false", "algorithm.dynamic_sampling=true", "algorithm.max_rounds=1", "rollout.G=4",
             "rollout.max_new_tokens=6", "train.steps=1",
             'reward.spec={"rewards": ["accuracy", "length"], "options": {"length_max": 1}}')

    def dynsample(out, *more):
        train(rl_config(tiny_ckpt, rl_set, out, *extra, *more))
        row = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x][0]
        return row["dynsample/generated"], row["dynsample/dropped"]

    assert dynsample(tmp_path / "default") == (2.0, 2.0)  # every group: accuracy all 0
    assert dynsample(tmp_path / "reward", "algorithm.dynamic_sampling_metric=reward") == (2.0, 0.0)


@pytest.mark.slow
def test_short_rlep_run_replays_logs_evaluates_and_exports(tiny_ckpt, rl_set, tmp_path):
    cfg = rl_config(tiny_ckpt, rl_set, tmp_path / "run", "train.steps=2", "algorithm.ppo_epochs=2",
               "algorithm.mini_batches=2", "algorithm.dynamic_sampling=true", "algorithm.difficulty=mixed_up",
               f"eval.manifest={rl_set['test']}", "eval.max_new_tokens=3", "eval.every=1",
               "algorithm.mode_mix={think: 1, no_think: 1}")
    summary = train(cfg)
    run = tmp_path / "run"
    assert summary["finished"] and summary["steps"] == 2 and summary["tree"] and summary["replay_M"] == 2
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        # every question holds two stored answers, so each group is 2 fresh + 2 replayed
        assert r["replay_share"] == pytest.approx(0.5)
        assert r["replay_reward"] > r["reward/mean"]  # reference answers verify; random text does not
        assert r["tokens_per_s"] > 0 and r["response_length"] > 0 and r["entropy"] > 0
        assert r["dynsample/kept_frac"] == 1.0  # replayed successes make every group informative
        for key in ("pass_rate", "clip_frac", "approx_kl", "reward/accuracy", "reward/format", "time/rollout",
                    "time/old_logprob", "time/update", "pool/entries", "grad_norm"):
            assert key in r, key
    assert any(r["loss"] != 0 for r in steps)
    curve = json.loads((run / "eval_curve.json").read_text())
    assert [c["step"] for c in curve] == [0, 1, 2] and all(c["n"] == 3 and 0 <= c["accuracy"] <= 1 for c in curve)
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 1, 2]
    assert ReplayPool.load_jsonl(run / "pool.jsonl").stats()["pool/questions"] == 4
    final = KeyeVL.from_pretrained(run / "final").state_dict()
    start = KeyeVL.from_pretrained(tiny_ckpt).state_dict()
    assert any(not torch.equal(final[k], start[k]) for k in start)


def test_held_out_accuracy_greedy_and_sampled(tiny_ckpt, rl_set):
    from keye.processing.processor import KeyeProcessor
    from keye.rl import load_rl_prompts
    from keye.rl.loop.evaluate import greedy_accuracy

    model = KeyeVL.from_pretrained(tiny_ckpt)
    proc = KeyeProcessor.from_pretrained(tiny_ckpt)
    prompts = load_rl_prompts(rl_set["test"])

    class Half:  # passes answers whose first token id is even: about half, so changes in the decoding show
        def __init__(self):
            self.seen = []

        def __call__(self, samples):
            self.seen += [s.response_ids.tolist() for s in samples]
            return type("Scores", (), {"passed": [len(s.response_ids) > 0 and int(s.response_ids[0]) % 2 == 0
                                                  for s in samples]})()

    scorer = Half()
    kw = dict(max_new_tokens=3, batch_size=4)  # one chunk: the greedy answers, then the sampled ones
    greedy = greedy_accuracy(model, proc, prompts, scorer, **kw)
    assert set(greedy) == {"accuracy", "n"} and greedy["n"] == len(prompts) == len(scorer.seen)
    passed = sum(len(r) > 0 and r[0] % 2 == 0 for r in scorer.seen)
    assert greedy["accuracy"] == passed / len(prompts)

    torch.manual_seed(7)
    expected_next = torch.rand(3)
    torch.manual_seed(7)
    scorer.seen = []
    a = greedy_accuracy(model, proc, prompts, scorer, samples=5, temperature=1.0, seed=3, **kw)
    assert torch.equal(torch.rand(3), expected_next)  # sampling leaves the training RNG stream alone
    assert a["accuracy"] == greedy["accuracy"] and a["samples"] == 5
    assert len(scorer.seen) == len(prompts) * (1 + 5)
    sampled = scorer.seen[len(prompts) :]
    assert a["sampled_accuracy"] == sum(len(r) > 0 and r[0] % 2 == 0 for r in sampled) / (5 * len(prompts))
    b = greedy_accuracy(model, proc, prompts, scorer, samples=5, temperature=1.0, seed=3, per_prompt=True, **kw)
    table = b.pop("per_prompt")
    assert b == a  # a private generator: the same seed draws the same answers at every evaluation
    assert set(table) == {p.id for p in prompts} and all(t[2] == 5 for t in table.values())
    assert sum(t[0] for t in table.values()) == greedy["accuracy"] * len(prompts)
    assert sum(t[1] for t in table.values()) == a["sampled_accuracy"] * 5 * len(prompts)
    # at a vanishing temperature every sample is the greedy answer
    cold = greedy_accuracy(model, proc, prompts, scorer, samples=3, temperature=1e-6, seed=0, **kw)
    assert cold["sampled_accuracy"] == pytest.approx(greedy["accuracy"])


@pytest.mark.slow
def test_tree_on_equals_tree_off(tiny_ckpt, rl_set, tmp_path):
    # with a reference model and a KL term, so the reference log-prob pass is compared too
    args = ("train.steps=2", "algorithm.ppo_epochs=2", "algorithm.reference=true", "algorithm.kl_coef=0.05",
            "algorithm.kl_estimator=k3")
    on = train(rl_config(tiny_ckpt, rl_set, tmp_path / "on", "tree.enabled=true", *args))
    off = train(rl_config(tiny_ckpt, rl_set, tmp_path / "off", "tree.enabled=false", *args))
    assert on["tree"] and not off["tree"]
    assert on["rewards"] == off["rewards"]
    assert on["losses"] == pytest.approx(off["losses"], abs=1e-5)
    assert any(x != 0 for x in on["losses"])
    kls = [json.loads(x).get("kl") for x in (tmp_path / "on/metrics.jsonl").read_text().splitlines()]
    assert all(k is not None and k >= 0 for k in kls) and kls[-1] > 0  # k3 >= 0; the policy has left the reference


@pytest.mark.slow
def test_two_process_data_parallel_run(tiny_ckpt, rl_set, tmp_path):
    """2 ranks, explicit gradient all-reduce: the run completes and both replicas end identical.

    Loss parity with one process is not expected: each rank samples its own prompts with its own
    generator stream (seeded by rank), so the rollout batches themselves differ from a 1-process run.
    """
    out = tmp_path / "ddp"
    torchrun([REPO / "tests/train/_dist_rlep.py", out, f"model.path={tiny_ckpt}",
              f"data.manifest={rl_set['train']}", "data.prompts_per_step=2", "rollout.G=2", "rollout.max_new_tokens=4",
              f"replay.pool={rl_set['pool']}", "replay.M=1", "train.lr=1e-3", "train.steps=2", "log.progress=false",
              "train.device=cpu", "algorithm.mini_batches=2"], env={"KEYE_LOG_LEVEL": "WARNING"}, timeout=600)
    sums = {r: (out / f"checksum_rank{r}.txt").read_text() for r in ("0", "1")}
    assert sums["0"] == sums["1"], sums
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == "ddp" and summary["steps"] == 2
    assert all(x == x for x in summary["losses"]) and any(x != 0 for x in summary["losses"])
    with torch.no_grad():
        start = float(sum(p.double().sum() for p in KeyeVL.from_pretrained(tiny_ckpt).parameters()))
    assert start != float(sums["0"])  # the replicas trained


@pytest.mark.slow
def test_rlep_collect_cli_writes_a_valid_pool(tiny_ckpt, rl_set, tmp_path):
    from keye.cli import main as keye_main

    reward = tmp_path / "reward.yaml"
    reward.write_text("rewards: [format]\n")  # a random model passes format checks, not accuracy
    out = tmp_path / "pool.jsonl"
    rc = keye_main(["rlep", "collect", "--policy", str(tiny_ckpt), "--data", str(rl_set["train"]), "--out", str(out),
                    "--n", "3", "--max-new-tokens", "4", "--min-successes", "1", "--reward", str(reward)])
    assert rc in (0, None)
    lines = out.read_text().splitlines()
    assert lines
    ids = {r["id"] for r in map(json.loads, rl_set["train"].read_text().splitlines())}
    for line in lines:
        row = json.loads(line)
        assert row["question_id"] in ids and row["token_ids"] and row["metadata"]["source"] == "collect"
    pool = ReplayPool.load_jsonl(out)
    assert len(pool) == len(lines) and all(pool.count(q) <= 3 for q in pool.questions())


@pytest.mark.slow
def test_cli_prompt_filter_reports_an_empty_question_set(tiny_ckpt, rl_set, tmp_path, capsys):
    """``keye train rlep`` with pre-run filtering: a random policy never answers correctly, so every sampling
    accuracy is 0, no prompt is in (0, 1), and the command fails with a typed, readable error."""
    from keye.cli import main as keye_main

    rc = keye_main(["train", "rlep", f"model.path={tiny_ckpt}", f"data.manifest={rl_set['train']}",
                    "data.filter_samples=2", "rollout.max_new_tokens=3", f"checkpoint.out_dir={tmp_path / 'f'}",
                    "log.progress=false", "train.device=cpu"])
    assert rc == 1
    assert "prompt filtering kept no prompt" in capsys.readouterr().err
