"""Measure one rank's memory of an SFT forward/backward with context parallelism 2 (run by tests/train/test_sft_plan.py
under torchrun, gloo).

Args: ``OUT_DIR``. With and without gradient checkpointing, the small test model as the recipe trains it (float32
weights under bf16 autocast, the chunked loss) runs the packed row of ``test_sft_plan._micro_batch`` split over the
two ranks (``keye.train.context_parallel``); each rank writes ``rank<r>.json`` with, per case, the bytes alive at the
end of the forward and the forward's and the backward's peaks (tests/rl/_memtrack.py; parameter gradients excluded),
and, under ``fsdp2``, the bytes autocast's cache holds at the end of a checkpointed forward of the FSDP2-wrapped model
(alive inside the autocast region less alive after it) with the bf16 bytes of the whole model's Linear / Conv weights.
"""

import json
import sys
from pathlib import Path

import torch

from keye.train import dist as kdist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.rl._memtrack import LiveBytes  # noqa: E402
from tests.train.test_sft_plan import LAYERS, _micro_batch, small_config  # noqa: E402


def measure(cp, checkpointing: bool) -> dict:
    """One forward/backward of the split row on this rank."""
    from keye.model.keye_vl import KeyeVL
    from keye.sft.inputs import model_inputs
    from keye.train.loss import LossRequest

    torch.manual_seed(0)
    model = KeyeVL(small_config(**LAYERS)).train()  # float32 weights: the recipe's bf16 training under autocast
    model.always_run_vision = True
    if checkpointing:
        model.gradient_checkpointing_enable()
    mb = _micro_batch()
    inputs = model_inputs(mb, torch.device("cpu"))
    with LiveBytes() as mem:
        hooks = mem.exclude_grads(model.parameters())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**inputs, loss_reduction="sum", loss_request=LossRequest(32), context_parallel=cp).loss
            end = mem.current()
        forward = mem.peak
        loss.backward()
        backward = mem.peak
    for h in hooks:
        h.remove()
    pix = mb["pixel_values"].nbytes  # allocated before the mode, counted by the plan
    return {"end_of_forward": end + pix, "forward_peak": forward + pix, "backward_peak": backward + pix}


def fsdp2_autocast_cache(info) -> dict:
    """Autocast's cache at the end of a checkpointed forward of the FSDP2-wrapped model (float32 weights, as
    keye.train.dist.wrap_model shards them; the output is dropped, so nothing is saved for a backward), and the
    bf16 bytes of every Linear / Conv weight of the whole model."""
    from keye.model.keye_vl import KeyeVL
    from keye.sft.inputs import model_inputs

    torch.manual_seed(0)
    model = KeyeVL(small_config(**LAYERS)).train()
    model.always_run_vision = True
    model.gradient_checkpointing_enable()
    linear = sum(p.numel() for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))
                 for p in m.parameters(recurse=False))
    kdist.wrap_model(model, "fsdp2", info)
    inputs = model_inputs(_micro_batch(), torch.device("cpu"))
    inputs.pop("labels")
    with LiveBytes() as mem:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(**inputs, logits_to_keep=1)
            inside = mem.current()
        after = mem.current()
    return {"cache": inside - after, "copies": 2 * linear}


if __name__ == "__main__":
    from keye.train.context_parallel import ContextParallel

    info = kdist.init_distributed("cpu")
    try:
        cp = ContextParallel.create(2, info.rank, info.world_size, num_heads=small_config().text.num_attention_heads)
        out = {str(ckpt): measure(cp, ckpt) for ckpt in (False, True)}
        out["fsdp2"] = fsdp2_autocast_cache(info)
        Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
        (Path(sys.argv[1]) / f"rank{info.rank}.json").write_text(json.dumps(out))
    finally:
        kdist.cleanup()
