"""``keye sft plan`` (keye.sft.plan) against the memory of a real SFT step of a small model on CPU.

The model is loaded as the recipe loads it (:func:`keye.sft.model.load_train_model`: a bf16 checkpoint trained as
float32 weights under bf16 autocast) and stepped by :func:`keye.sft.step.optimizer_step`; parameter, gradient and
AdamW bytes are compared byte for byte, the autocast weight copies, saved activations, the forward's and the
backward's peaks with the bytes measured by tests/rl/_memtrack.py, the chunked loss head with its measured peak.
"""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stdout

import pytest
import torch

from keye.errors import KeyeConfigError
from keye.sft.plan import LoraPlan, head_chunk_bytes, plan_sft_memory
from tests.paths import REPO_ROOT
from tests.rl._memtrack import LiveBytes
from tests.rl.test_plan import CONFIG_8B, small_config
from tests.torchrun import torchrun

L, GRID, VISION = 128, (1, 4, 8), 8  # one packed row: 128 tokens, one 4 x 8-patch image (8 merged tokens)
LAYERS = dict(decoder_layers=2, vision_layers=1)


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    """The small test model saved as a bf16 checkpoint."""
    from keye.model.keye_vl import KeyeVL

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("small") / "ckpt"
    KeyeVL(small_config(**LAYERS)).to(torch.bfloat16).save_pretrained(path)
    return path


def _micro_batch(answer_from: int = 64) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 900, (1, L), generator=g)
    ids[0, 4 : 4 + VISION] = 1005
    labels = ids.clone()
    labels[0, :answer_from] = -100
    return dict(input_ids=ids, attention_mask=torch.ones(1, L, dtype=torch.long), labels=labels,
                seq_lens=torch.tensor([L]), packed=True, pixel_values=torch.randn(GRID[1] * GRID[2], 3, 14, 14, generator=g),
                image_grid_thw=torch.tensor([list(GRID)]), num_label_tokens=int((labels[0, 1:] != -100).sum()),
                num_tokens=L, num_samples=1)


def _train_model(path, checkpointing: bool, stage: str = "full"):
    from keye.sft.config import SFTConfig
    from keye.sft.model import load_train_model
    from keye.train.dist import DistInfo

    cfg = SFTConfig()
    cfg.model.path, cfg.model.dtype, cfg.model.gradient_checkpointing = str(path), "bfloat16", checkpointing
    cfg.train.stage = stage
    return load_train_model(cfg, DistInfo(), path)


def _plan(checkpointing: bool, chunk: int = 32, **kw):
    return plan_sft_memory(small_config(**LAYERS), gpus=1, strategy="ddp", seq_len=L, vision_tokens=VISION,
                           answer_tokens=_micro_batch()["num_label_tokens"], gradient_checkpointing=checkpointing,
                           loss_chunk_tokens=chunk, overhead_gb=0, **kw)


def test_state_bytes_and_step_peak_of_a_real_sft_step(small_ckpt):
    """One optimizer_step on the recipe's model (stage llm_only: float32 trainable weights, the vision tower frozen
    in bf16): parameters, gradients and AdamW states equal the plan's items; the step's measured peak is within
    10 % of the plan's (each part of the step less what was there before it), and not more than 5 % below it."""
    from keye.sft.step import optimizer_step
    from keye.train.dist import DistInfo, Wrapped
    from keye.train.optim import STAGE_FREEZE

    tm = _train_model(small_ckpt, checkpointing=True, stage="llm_only")
    assert tm.amp
    model = tm.model
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True)
    grads = {}
    real_step = opt.step

    def step(*a, **k):
        grads["bytes"] = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
        return real_step(*a, **k)

    opt.step = step
    mb = _micro_batch()
    with LiveBytes() as mem:
        optimizer_step([mb], Wrapped(model, model, "none"), opt, DistInfo(), amp=True, tree_mode="off",
                       pad_token_id=0, grad_clip=1.0, step=0, loss_chunk_tokens=32)
    plan = _plan(True, frozen=STAGE_FREEZE["llm_only"])
    states = sum(s[k].nbytes for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
    params = sum(p.nbytes for p in model.parameters())
    assert plan.item("parameters") == params
    assert plan.item("gradients") == grads["bytes"]
    assert plan.item("AdamW states") == states
    measured = mem.peak + mb["pixel_values"].nbytes
    # the AdamW states are made by this first step (inside the measurement), the parameters were there before
    planned = max(plan.forward_bytes - states, plan.backward_bytes - states, plan.optimizer_bytes) - params
    assert 0.95 * measured <= planned <= 1.10 * measured, (planned, measured)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_autocast_copies_activations_and_peaks(small_ckpt, checkpointing):
    """The forward and backward optimizer_step runs (bf16 autocast over float32 weights, the chunked loss): bytes
    alive at the end of the forward (activations + autocast's weight copies) within 10 % of the plan's saved +
    copies; the forward's peak and the backward's peak (parameter gradients excluded) within 6 % of the plan's."""
    from keye.sft.inputs import model_inputs
    from keye.train.loss import LossRequest

    model = _train_model(small_ckpt, checkpointing).model
    mb = _micro_batch()
    pix = mb["pixel_values"].nbytes  # allocated before the mode, counted by the plan
    with LiveBytes() as mem:
        hooks = mem.exclude_grads(model.parameters())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**model_inputs(mb, torch.device("cpu")), loss_reduction="sum",
                         loss_request=LossRequest(32)).loss
            end_of_forward = mem.current() + pix
        forward_peak = mem.peak + pix
        loss.backward()
        backward_peak = mem.peak + pix
    for h in hooks:
        h.remove()
    plan = _plan(checkpointing)
    copies = plan.item("autocast bf16 weight copies")
    assert plan.item("activations saved") + copies == pytest.approx(end_of_forward, rel=0.10)
    states = plan.item("parameters") + plan.item("AdamW") + plan.item("gradients")
    assert plan.forward_bytes - states == pytest.approx(forward_peak, rel=0.06)
    assert plan.backward_bytes - states == pytest.approx(backward_peak, rel=0.06)


@pytest.mark.slow
def test_context_parallel_rank_memory(tmp_path):
    """Two gloo ranks split the row (keye.train.context_parallel, tests/train/_dist_sft_plan.py): on the rank that
    holds more (all targets fall in its half), the bytes alive at the end of the forward and the forward's and the
    backward's peaks are within 12 % of the plan's with context_parallel=2 (activations halved, the whole row's
    embeddings and the all-to-all buffers added), with and without checkpointing. Under FSDP2 (same launch) autocast's
    cache holds the bf16 copy of every layer's weights on each rank, unsharded, as the plan counts it."""
    torchrun([REPO_ROOT / "tests/train/_dist_sft_plan.py", tmp_path], env={"KEYE_LOG_LEVEL": "WARNING"}, timeout=600,
             cwd=REPO_ROOT)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for ckpt in (False, True):
        measured = {k: max(r[str(ckpt)][k] for r in ranks) for k in ranks[0][str(ckpt)]}
        plan = plan_sft_memory(small_config(**LAYERS), gpus=2, strategy="ddp", seq_len=L, vision_tokens=VISION,
                               answer_tokens=_micro_batch()["num_label_tokens"], gradient_checkpointing=ckpt,
                               loss_chunk_tokens=32, overhead_gb=0, context_parallel=2)
        states = sum(plan.item(n) for n in ("parameters", "AdamW", "gradients", "DDP gradient buckets"))
        end = plan.item("activations saved") + plan.item("autocast") + plan.item("context parallel")
        assert end == pytest.approx(measured["end_of_forward"], rel=0.12), ckpt
        assert plan.forward_bytes - states == pytest.approx(measured["forward_peak"], rel=0.12), ckpt
        assert plan.backward_bytes - states == pytest.approx(measured["backward_peak"], rel=0.12), ckpt
    # FSDP2 shards the float32 weights, not autocast's bf16 copies: each rank's cache holds the whole model's
    full = plan_sft_memory(small_config(**LAYERS), gpus=2, strategy="fsdp2", seq_len=L, loss_chunk_tokens=None)
    for r in ranks:
        assert r["fsdp2"]["cache"] == r["fsdp2"]["copies"] == full.item("autocast bf16 weight copies")


@pytest.mark.parametrize("amp", [True, False])
def test_loss_head_chunk_peaks(amp):
    """chunked_cross_entropy's peak above its inputs in the forward and in the backward (the head's final gradient
    excluded) vs head_chunk_bytes, within 15 %: float32 head under autocast, and a bf16 head."""
    from keye.config import KeyeVLConfig, TextConfig
    from keye.train.loss import chunked_cross_entropy

    text = TextConfig(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, mrope_section=(2, 3, 3))
    config = KeyeVLConfig(variant="1.5", text=text, vision=small_config().vision, torch_dtype="float32")
    m, chunk = 512, 128
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 8192, bias=False).to(torch.float32 if amp else torch.bfloat16)
    hidden = torch.randn(m, 32, dtype=torch.float32 if amp else torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 8192, (m,))
    with LiveBytes() as mem:
        hooks = mem.exclude_grads([head.weight, hidden])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss, _ = chunked_cross_entropy(hidden, targets, head, chunk_size=chunk)
        fwd = mem.peak
        base = mem.current()
        mem.peak = 0
        loss.backward()
        bwd = mem.peak - base
    for h in hooks:
        h.remove()
    planned_fwd, planned_bwd = head_chunk_bytes(config, dtype="float32" if amp else "bfloat16", amp=amp, chunk=chunk,
                                                targets=m)
    assert planned_fwd == pytest.approx(fwd, rel=0.15)
    assert planned_bwd == pytest.approx(bwd, rel=0.15)


def test_lora_counts_equal_peft(small_ckpt):
    """The plan's parameters with LoRA (r=4 on the LLM) equal the model apply_lora builds: trainable and total."""
    from keye.sft.config import SFTConfig
    from keye.train.lora import apply_lora

    model = _train_model(small_ckpt, checkpointing=False).model
    cfg = SFTConfig().lora
    cfg.r, cfg.targets = 4, ["llm"]
    model = apply_lora(model, cfg)
    plan = _plan(False, lora=LoraPlan(r=4, targets=("llm",)))
    assert plan.params.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert plan.params.total == sum(p.numel() for p in model.parameters())


def test_zero_and_fsdp2_state_bytes_follow_their_partitions():
    """ZeRO-2/3 (bf16 model, DeepSpeed's float32 master, gradients and AdamW states in ceil(numel / W) partitions;
    ZeRO-3's parameters too) and FSDP2 (float32 trainable shards of ceil(dim0 / W) rows) on 3 ranks."""
    import math

    from keye.train.plan import count_parameters

    counts = count_parameters(small_config())
    flat = sum(-(-math.prod(s) // 3) for _, s, _ in counts.shapes)
    dim0 = sum(-(-s[0] // 3) * math.prod(s[1:]) for _, s, _ in counts.shapes)
    kw = dict(gpus=3, seq_len=64, overhead_gb=0)
    z2 = plan_sft_memory(small_config(), strategy="zero2", **kw)
    z3 = plan_sft_memory(small_config(), strategy="zero3", **kw)
    f2 = plan_sft_memory(small_config(), strategy="fsdp2", **kw)
    assert z2.item("parameters (bf16)") == 2 * counts.total and z3.item("parameters (bf16)") == 2 * flat
    for p in (z2, z3):
        assert p.item("fp32 master weights") == 4 * flat and p.item("gradients (fp32 partition)") == 4 * flat
        assert p.item("AdamW states") == 8 * flat and not p.settings["amp"]
    assert f2.item("parameters") == 4 * dim0 and f2.item("AdamW states") == 8 * dim0 and f2.settings["amp"]


def test_cli_takes_the_recipe_settings():
    """--config: the row length from data.batch_tokens, the strategy, checkpointing and LoRA from the recipe, with
    its dot-list overrides; flags win over the recipe."""
    cfg = str(REPO_ROOT / "training/configs/keye_vl_8b_sft.yaml")
    rc, out = _cli("--config", cfg, "lora.enabled=true", "lora.r=8", "--json")
    s = json.loads(out)["settings"]
    assert rc == 0 and (s["seq_len"], s["strategy"], s["gradient_checkpointing"], s["lora_r"]) == (16384, "fsdp2", True, 8)
    rc, out = _cli("--config", cfg, "--seq-len", "4096", "--strategy", "zero2", "--no-gradient-checkpointing", "--json")
    s = json.loads(out)["settings"]
    assert (s["seq_len"], s["strategy"], s["gradient_checkpointing"]) == (4096, "zero2", False)


# ------------------------------------------------------------------------------------------------ CLI
def _cli(*args: str) -> tuple[int, str]:
    from keye.cli import main

    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(["sft", "plan", *args])
    return rc, buf.getvalue()


def test_cli_table_json_and_context_parallel():
    """The 8B at 32K on 8 x 80 GiB: the table lists every item and the verdict; --json carries the same items;
    context parallelism divides the saved activations by its degree (within the per-forward terms)."""
    rc, text = _cli("--seq-len", "32768", "--context-parallel", "2")
    assert rc == 0 and "FITS: peak" in text and "context parallel: full-row embeddings" in text
    rc, out = _cli("--seq-len", "32768", "--context-parallel", "1", "--json")
    one = json.loads(out)
    rc, out = _cli("--seq-len", "32768", "--context-parallel", "4", "--json")
    four = json.loads(out)
    saved = {p["settings"]["context_parallel"]: next(i["bytes"] for i in p["items"] if i["name"].startswith("activations"))
             for p in (one, four)}
    assert saved[4] == pytest.approx(saved[1] / 4, rel=0.01)
    assert one["peak_bytes"] == max(one["forward_bytes"], one["backward_bytes"], one["optimizer_bytes"])
    assert one["params"]["total"] > 8e9


def test_cli_does_not_fit_names_the_largest_item():
    rc, text = _cli("--seq-len", "131072", "--strategy", "ddp", "--no-gradient-checkpointing")
    assert rc == 0
    verdict = text.strip().splitlines()[-1]
    assert verdict.startswith("DOES NOT FIT") and "largest item: activations saved (without checkpointing)" in verdict


@pytest.mark.parametrize("args, message", [
    (["--strategy", "fsdp"], "strategy must be one of"),
    (["--context-parallel", "3"], "context_parallel=3 must divide gpus=8"),
    (["--gpus", "24", "--context-parallel", "12", "--seq-len", "36864"], "must divide the 32 attention heads"),
    (["--seq-len", "8k"], "--seq-len must be integers"),
    (["--strategy", "zero3", "--context-parallel", "2"], "context_parallel=2 needs strategy ddp or fsdp2"),
    (["--vision-fraction", "1.5"], "--vision-fraction"),
])
def test_cli_bad_settings_are_named(args, message, capsys):
    from keye.cli import main

    assert main(["sft", "plan", *args]) == 1
    assert message in capsys.readouterr().err


def test_api_bad_settings_are_named():
    with pytest.raises(KeyeConfigError, match="context_parallel=8 must divide the 4 attention heads"):
        plan_sft_memory(small_config(), gpus=8, seq_len=64, context_parallel=8)
    with pytest.raises(KeyeConfigError, match="answer_tokens must be in"):
        plan_sft_memory(small_config(), gpus=1, seq_len=64, vision_tokens=32, answer_tokens=40)
    with pytest.raises(KeyeConfigError, match="lora.targets has unknown"):
        plan_sft_memory(small_config(), gpus=1, seq_len=64, lora=LoraPlan(targets=("projector",)))


def test_readme_table_is_what_the_planner_prints():
    """README's "Will it fit?" table equals the output of the command printed above it."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index("### Will it fit?"):]
    command = re.search(r"```bash\n(keye sft plan [^\n]+)\n```", section).group(1)
    table = re.search(r"\n(\| sequence \|.*?)\n\n", section, re.S).group(1)
    rc, out = _cli(*command.split()[3:])
    assert rc == 0 and out.strip() == table.strip()
    assert CONFIG_8B.is_file()


def test_docs_commands_run_and_the_example_is_what_the_first_prints():
    """docs/sft_memory.md: each `keye sft plan` command runs; the example table's rows (notes abridged there) are
    the first command's (name, phase and GiB)."""
    doc = (REPO_ROOT / "docs/sft_memory.md").read_text()
    commands = [line.split("#")[0].split() for line in doc.splitlines() if line.startswith("keye sft plan")]
    assert len(commands) == 3
    outputs = []
    for argv in commands:
        rc, out = _cli(*argv[3:])
        assert rc == 0, argv
        outputs.append(out)
    example = doc[doc.index("```\nitem "):].split("```")[1].strip().splitlines()
    printed = {line[:79] for line in outputs[0].splitlines()}
    for line in example:
        assert line[:79] in printed, line
