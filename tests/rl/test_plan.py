"""The memory plan (keye.rl.learner.plan, ``keye rl plan``) against memory measured on CPU.

Parameters, gradients and AdamW states are compared byte for byte with the tensors of a trained small model;
FSDP2 shards with what each of 2 gloo ranks holds; activations with the tensors autograd saves
(``saved_tensors_hooks``) and with the bytes alive after the forward and at the backward's peak
(tests/rl/_memtrack.py); the log-prob chunk with its measured peak; the KV cache with the model's own cache.
"""

from __future__ import annotations

import io
import json
import math
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from keye.config import KeyeVLConfig, TextConfig, VisionConfig
from keye.errors import KeyeConfigError
from keye.rl.learner.plan import activation_bytes, count_parameters, logprob_chunk_bytes, plan_memory
from tests.paths import REPO_ROOT
from tests.rl._memtrack import LiveBytes
from tests.torchrun import torchrun

B, L, GRID = 2, 96, (1, 8, 8)  # two rows of 96 tokens, one 8 x 8-patch image each (16 merged tokens)
PATCHES = B * GRID[1] * GRID[2]
CONFIG_8B = REPO_ROOT / "training/configs/models/keye_vl_1_5_8b.json"


def small_config(decoder_layers: int = 3, vision_layers: int = 2) -> KeyeVLConfig:
    """A small Keye-VL-1.5 with GQA (4 query / 2 kv heads), sizes unlike the 8B's ratios."""
    text = TextConfig(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=decoder_layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, mrope_section=(4, 6, 6))
    vision = VisionConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=vision_layers, num_attention_heads=4,
                          image_size=112, patch_size=14)
    return KeyeVLConfig(variant="1.5", text=text, vision=vision, bos_token_id=1000, eos_token_id=1001,
                        vision_start_token_id=1002, vision_end_token_id=1003, vision_token_id=1004,
                        image_token_id=1005, video_token_id=1006, torch_dtype="float32")


def batch(dtype: torch.dtype, padded: bool = True) -> dict[str, torch.Tensor]:
    """Two rows with one image each; the first row left-padded by 3 tokens when ``padded``."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 900, (B, L), generator=g)
    ids[:, 4 : 4 + GRID[1] * GRID[2] // 4] = 1005
    att = torch.ones(B, L, dtype=torch.long)
    if padded:
        att[0, :3] = 0
    pix = torch.randn(PATCHES, 3, 14, 14, generator=g).to(dtype)
    return dict(input_ids=ids, attention_mask=att, pixel_values=pix, image_grid_thw=torch.tensor([list(GRID)] * B))


def _model(dtype: torch.dtype, checkpointing: bool = False, **sizes):
    from keye.model.keye_vl import KeyeVL

    torch.manual_seed(0)
    model = KeyeVL(small_config(**sizes)).to(dtype).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def _plan(**kw):
    args = dict(world_size=1, strategy="ddp", dtype="float32", micro_batch_tokens=B * L, micro_batch_sequences=B,
                vision_patches=PATCHES, rollout={"engine": "vllm", "colocated": False, "gpu_memory_utilization": 0.9,
                                                 "max_model_len": 256, "max_num_seqs": 4})
    args.update(kw)
    return plan_memory(small_config(), **args)


# ------------------------------------------------------------------------------ parameters / optimizer
def test_parameter_count_of_the_8b_config_equals_the_architecture_formula():
    """count_parameters (meta-device shapes) vs the parameter formula of the checkpoint tables (Qwen3 decoder
    without biases, SigLIP layers with biases, the 1.5 projector with its post-merge LayerNorm)."""
    c = KeyeVLConfig.from_json_file(CONFIG_8B)
    t, v = c.text, c.vision
    d, f, q, k = t.hidden_size, t.intermediate_size, t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    layer = d * q + 2 * d * k + q * d + 3 * d * f + 2 * d + 2 * t.head_dim
    llm = 2 * t.vocab_size * d + t.num_hidden_layers * layer + d
    dv, fv = v.hidden_size, v.intermediate_size
    vlayer = 4 * (dv * dv + dv) + 2 * 2 * dv + 2 * dv * fv + fv + dv
    vision = (3 * 14 * 14 * dv + dv) + (384 // 14) ** 2 * dv + v.num_hidden_layers * vlayer + 2 * dv
    merged = 4 * dv
    projector = 2 * merged + merged * merged + merged + merged * d + d
    counts = count_parameters(c)
    assert dict(counts.towers) == {"vision": vision, "projector": projector, "llm": llm}
    assert counts.total == vision + projector + llm
    assert counts.decoder_layer == layer and counts.vision_layer == vlayer
    assert counts.root == counts.total - t.num_hidden_layers * layer - v.num_hidden_layers * vlayer
    frozen = count_parameters(c, frozen=["vision"])
    assert frozen.trainable == projector + llm


@pytest.mark.parametrize("dtype,frozen", [("float32", ()), ("bfloat16", ()), ("float32", ("vision",))])
def test_parameters_gradients_adamw_states_exact(dtype, frozen):
    """After one AdamW step the bytes of parameters, gradients and exp_avg / exp_avg_sq equal the plan's items."""
    from keye.train.optim import tower_of

    model = _model(getattr(torch, dtype))
    for name, p in model.named_parameters():
        p.requires_grad_(tower_of(name) not in frozen)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    out = model(**batch(getattr(torch, dtype)), logits_to_keep=1, output_hidden_states=True)
    (out.hidden_states.float().pow(2).mean() + out.logits.float().sum()).backward()
    opt.step()
    measured = {
        "params": sum(p.nbytes for p in model.parameters()),
        "grads": sum(p.grad.nbytes for p in model.parameters() if p.grad is not None),
        "states": sum(s[k].nbytes for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")),
    }
    plan = _plan(dtype=dtype, frozen=frozen)
    assert plan.item(f"policy parameters ({dtype})") == measured["params"]
    assert plan.item("gradients") == measured["grads"]
    assert plan.item("AdamW states (exp_avg, exp_avg_sq)") == measured["states"]
    if frozen:
        assert measured["grads"] < measured["params"]


def test_master_weights_and_zero3_state_bytes():
    """float32 master weights: 16 bytes per trainable element on one rank (2 + 2 + 4 + 8 in bf16 with ddp),
    ZeRO-3 partitions of ceil(numel / world) elements."""
    counts = count_parameters(small_config())
    n = counts.total
    plan = _plan(dtype="bfloat16", master_weights=True)
    assert plan.item("policy parameters (bfloat16)") + plan.item("fp32 master weights") == 6 * n
    assert plan.item("gradients") + plan.item("AdamW states (exp_avg, exp_avg_sq)") == 12 * n
    z3 = _plan(dtype="bfloat16", strategy="zero3", world_size=3)
    part = sum(-(-math.prod(s) // 3) for _, s, _ in counts.shapes)
    assert z3.item("fp32 master weights") == 4 * part
    assert z3.item("AdamW states (exp_avg, exp_avg_sq)") == 8 * part


@pytest.mark.slow
def test_fsdp2_shards_per_rank_match_the_plan(tmp_path):
    """Two gloo ranks under FSDP2: each rank's local parameter / gradient / AdamW shard bytes. Rank 0 holds
    ceil(dim0 / 2) rows of every parameter, exactly the plan; rank 1 the rest (the plan's padding bound), and
    the ranks together hold the whole model."""
    torchrun([REPO_ROOT / "tests/rl/_dist_plan.py", tmp_path, "-", "vision"], env={"KEYE_LOG_LEVEL": "WARNING"},
             timeout=600, cwd=REPO_ROOT)
    for frozen in ("-", "vision"):
        out = tmp_path / frozen
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
        fro = () if frozen == "-" else (frozen,)
        plan = _plan(strategy="fsdp2", world_size=2, frozen=fro)
        one = _plan(strategy="ddp", world_size=1, frozen=fro)
        for key, item in (("params", "policy parameters (float32)"), ("grads", "gradients"),
                          ("states", "AdamW states (exp_avg, exp_avg_sq)")):
            assert ranks[0][key] == plan.item(item), key
            assert ranks[0][key] + ranks[1][key] == one.item(item), key
            assert ranks[1][key] <= plan.item(item)


# ----------------------------------------------------------------------------------------- activations
def _saved_bytes(model, inputs) -> int:
    """Bytes of the distinct non-parameter storages autograd saves during the forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**inputs, logits_to_keep=1, output_hidden_states=True)
    return sum(seen.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("padded", [False, True])
def test_saved_activations_without_checkpointing(dtype, padded):
    """Tensors autograd saves in a training forward vs activation_bytes(...).saved, within 2 % (the only
    difference: CPU LayerNorm keeps its statistics in bf16 where CUDA keeps float32)."""
    for layers in ((3, 2), (2, 3)):
        model = _model(getattr(torch, dtype), decoder_layers=layers[0], vision_layers=layers[1])
        measured = _saved_bytes(model, batch(getattr(torch, dtype), padded))
        plan = activation_bytes(small_config(*layers), dtype=dtype, tokens=B * L, sequences=B, vision_patches=PATCHES,
                                response_tokens=0, padded=padded)
        assert plan.saved == pytest.approx(measured, rel=0.02)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_activations_with_and_without_checkpointing_alive_and_peak(dtype):
    """Bytes alive after the forward (what the backward needs) within 3 % of the plan's saved bytes, with and
    without gradient checkpointing; the backward's peak (parameter gradients excluded) within 25 %, the plan
    not below it; checkpointing keeps far less."""
    td = getattr(torch, dtype)
    results = {}
    for ckpt in (False, True):
        model = _model(td, checkpointing=ckpt)
        inputs = batch(td)
        with LiveBytes() as mem:
            hooks = mem.exclude_grads(model.parameters())
            out = model(**inputs, logits_to_keep=1, output_hidden_states=True)
            alive = mem.current() + inputs["pixel_values"].nbytes  # the pixels were allocated before the mode
            loss = out.hidden_states.float().pow(2).mean() + out.logits.float().sum()
            mem.peak = 0
            loss.backward()
        for h in hooks:
            h.remove()
        plan = activation_bytes(small_config(), dtype=dtype, tokens=B * L, sequences=B, vision_patches=PATCHES,
                                response_tokens=0, padded=True, gradient_checkpointing=ckpt)
        peak = mem.peak + inputs["pixel_values"].nbytes
        assert plan.saved == pytest.approx(alive, rel=0.03), ckpt
        assert peak * 0.98 <= plan.backward_peak <= 1.25 * peak, ckpt
        results[ckpt] = alive
    assert results[True] < 0.2 * results[False]


def _logprob_backward_peak(vocab: int, hidden_size: int, tokens: int, chunk: int | None, dtype) -> int:
    """Peak bytes of chunked_token_logprobs' backward (with entropy) above what its forward left, the accumulated
    head and hidden gradients excluded, for a ``[vocab, hidden_size]`` head over ``tokens`` rows."""
    from keye.train.logprobs import chunked_token_logprobs

    torch.manual_seed(0)
    head = torch.nn.Linear(hidden_size, vocab, bias=False).to(dtype)
    hidden = torch.randn(tokens, hidden_size, dtype=dtype, requires_grad=True)
    with LiveBytes() as mem:
        hooks = mem.exclude_grads([head.weight, hidden])
        lp, ent = chunked_token_logprobs(hidden, torch.arange(tokens), torch.randint(0, vocab, (tokens,)), head,
                                         with_entropy=True, chunk_size=chunk)
        loss = lp.sum() + ent.sum()
        base = mem.current()
        mem.peak = 0
        loss.backward()
    for h in hooks:
        h.remove()
    return mem.peak - base


def _head_config(vocab: int, hidden_size: int) -> KeyeVLConfig:
    text = TextConfig(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, mrope_section=(2, 3, 3))
    return KeyeVLConfig(variant="1.5", text=text, vision=small_config().vision, torch_dtype="float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logprob_chunk_peak(dtype):
    """Peak bytes of the chunked log-softmax's backward above what the forward left (the accumulated head and
    hidden gradients excluded) vs logprob_chunk_bytes, within 15 %, for several chunk sizes and unchunked."""
    config, m = _head_config(8192, 32), 512
    for chunk in (64, 128, None):
        planned = logprob_chunk_bytes(config, dtype=dtype, chunk=chunk, response_tokens=m)
        assert planned == pytest.approx(_logprob_backward_peak(8192, 32, m, chunk, getattr(torch, dtype)),
                                        rel=0.15), chunk


def test_logprob_head_with_answer_length():
    """A bf16 head wide enough that its float32 gradient sum and g^T h temporaries outweigh the chunk's buffers
    (the float32 head's formula is test_logprob_chunk_peak's): the measured backward peak of
    chunked_token_logprobs vs logprob_chunk_bytes within 10 % at 256 and 1024 answer tokens, and what the longer
    answers add within 15 % of the plan's answer-length term."""
    d, v = 128, 1024
    config = _head_config(v, d)
    measured, planned = {}, {}
    for m in (256, 1024):
        measured[m] = _logprob_backward_peak(v, d, m, 64, torch.bfloat16)
        planned[m] = logprob_chunk_bytes(config, dtype="bfloat16", chunk=64, response_tokens=m)
        assert planned[m] == pytest.approx(measured[m], rel=0.10), m
    assert planned[1024] - planned[256] == pytest.approx(measured[1024] - measured[256], rel=0.15)


def test_kv_cache_bytes_per_token_equal_the_models_cache():
    """The rollout KV bytes per token (at bf16) equal the bytes per position of keye's own KV cache after a
    prefill of a bf16 model."""
    from keye.model.text import KVCache

    model = _model(torch.bfloat16).eval()
    n = 40
    cache = KVCache(len(model.model.layers))
    with torch.no_grad():
        model(input_ids=torch.randint(0, 900, (1, n)), past_key_values=cache, use_cache=True)
    per_token = sum(t.nbytes for t in cache.keys + cache.values) / n
    plan = _plan(dtype="bfloat16")
    assert plan.kv["bytes_per_token"] == per_token


# ------------------------------------------------------------------------------------------ the plan
def _cli(*args: str) -> tuple[int, str]:
    from keye.cli import main

    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(["rl", "plan", *args])
    return rc, buf.getvalue()


def test_8b_recipe_plan_offline():
    """The 8B recipe plans offline from the bundled config: replicated bf16 + AdamW (8 bytes per parameter plus
    activations) does not fit 80 GiB, FSDP2 on 8 GPUs with colocated vLLM does; --json carries every item and
    the totals are the sums of their items."""
    cfg = str(REPO_ROOT / "training/configs/keye_vl_8b_rlep.yaml")
    rc, text = _cli("--config", cfg, "--strategy", "ddp")
    assert rc == 0 and "DOES NOT FIT" in text
    rc, text = _cli("--config", cfg, "--strategy", "fsdp2", "--gpus", "8", "--gpu-memory-gb", "80")
    assert rc == 0 and "FITS:" in text and "DOES NOT FIT" not in text
    rc, text = _cli("--config", cfg, "--strategy", "fsdp2", "--json")
    plan = json.loads(text)
    n = count_parameters(KeyeVLConfig.from_json_file(CONFIG_8B)).total
    assert plan["params"]["total"] == n and plan["fits"]
    items = {i["name"]: i for i in plan["items"]}
    assert items["policy parameters (bfloat16)"]["bytes"] >= 2 * n // 8
    both = sum(i["bytes"] for i in plan["items"] if i["phase"] == "both")
    rollout = sum(i["bytes"] for i in plan["items"] if i["phase"] == "rollout")
    assert plan["rollout_bytes"] == both + max(rollout, int(plan["settings"]["gpu_memory_utilization"] * plan["gpu_bytes"]))
    assert plan["learner_bytes"] <= plan["gpu_bytes"] and plan["rollout_bytes"] <= plan["gpu_bytes"]


def test_plan_scales_with_gpus_and_checkpointing():
    """Sharded state shrinks with the GPU count, activations with checkpointing, the chunk with its size."""
    c = KeyeVLConfig.from_json_file(CONFIG_8B)
    kw = dict(strategy="fsdp2", micro_batch_tokens=4 * 5120, micro_batch_sequences=4, vision_patches=4 * 5120,
              response_tokens=4 * 3072, rollout={"max_model_len": 5120})
    p8 = plan_memory(c, world_size=8, **kw)
    p4 = plan_memory(c, world_size=4, **kw)
    assert p4.item("AdamW states (exp_avg, exp_avg_sq)") > 1.9 * p8.item("AdamW states (exp_avg, exp_avg_sq)")
    off = plan_memory(c, world_size=8, **{**kw, "gradient_checkpointing": False})
    assert off.item("activations saved (without checkpointing)") > 10 * p8.item("activations saved (with checkpointing)")
    assert not off.fits and "learner phase needs" in off.reason
    whole = plan_memory(c, world_size=8, **{**kw, "logprob_chunk": None})
    head = "log-prob head (chunk x vocab, answer rows)"
    assert whole.item(head) > 2 * p8.item(head)
    longer = plan_memory(c, world_size=8, **{**kw, "response_tokens": 4 * 6144})
    assert longer.item(head) - p8.item(head) == 4 * 3072 * (2 * 4096 + 28)  # the answer-length term alone


def test_bad_input_is_named():
    c = small_config()
    with pytest.raises(KeyeConfigError, match="strategy"):
        plan_memory(c, world_size=2, strategy="fsdp", micro_batch_tokens=8)
    with pytest.raises(KeyeConfigError, match="rollout has unknown key"):
        plan_memory(c, world_size=2, micro_batch_tokens=8, rollout={"gpu_util": 0.5})
    with pytest.raises(KeyeConfigError, match="gpu_memory_utilization"):
        plan_memory(c, world_size=2, micro_batch_tokens=8, rollout={"gpu_memory_utilization": 1.5})
    cfg = str(REPO_ROOT / "training/configs/keye_vl_8b_rlep.yaml")
    from keye.cli import main

    assert main(["rl", "plan", "--config", cfg, "model.path=nobody/NoSuchModel-1B"]) == 1
    with pytest.raises(KeyeConfigError, match="--model-config"):
        from keye.rl.cli import resolve_model_config

        resolve_model_config("nobody/NoSuchModel-1B")


def test_tiny_recipe_plans_from_the_checkpoint_dir():
    """model.path=keye-tiny resolves to the embedded checkpoint's config.json."""
    rc, text = _cli("--config", str(REPO_ROOT / "training/configs/tiny_synth_rlep.yaml"), "--gpus", "1",
                    "--gpu-memory-gb", "16", "--json")
    plan = json.loads(text)
    assert rc == 0 and plan["fits"]
    tiny = KeyeVLConfig.from_json_file(REPO_ROOT / "keye/assets/keye-tiny/config.json")
    assert plan["params"]["total"] == count_parameters(tiny).total


def test_table_lists_every_item_in_gib():
    plan = _plan()
    table = plan.table()
    for it in plan.items:
        assert it.name in table
    assert ("FITS" if plan.fits else "DOES NOT FIT") in table
    assert Path(CONFIG_8B).is_file()
