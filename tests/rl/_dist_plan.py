"""Measure FSDP2 shard bytes per rank (run by tests/rl/test_plan.py under torchrun, gloo).

Args: ``OUT_DIR FROZEN [FROZEN ...]``: each FROZEN is comma-separated towers or ``-``; one run per value, all in
one process group, results in ``OUT_DIR/FROZEN``. Each run wraps the small test model the way
``keye.train.dist.wrap_model`` does (``fully_shard`` per decoder and vision layer, then the root), runs one
forward/backward and one AdamW step, and writes ``rank<r>.json`` with the bytes of this rank's local
parameter, gradient and optimizer-state shards."""

import json
import sys
from pathlib import Path

import torch

from keye.train import dist as kdist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.rl.test_plan import batch, small_config  # noqa: E402


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def run(out: Path, frozen: list[str], info: kdist.DistInfo) -> None:
    """One FSDP2 step of the small model with ``frozen`` towers; writes this rank's shard bytes under ``out``."""
    from keye.model.keye_vl import KeyeVL
    from keye.train.optim import tower_of

    torch.manual_seed(0)
    model = KeyeVL(small_config()).train()
    for name, p in model.named_parameters():
        p.requires_grad_(tower_of(name) not in frozen)
    wrapped = kdist.wrap_model(model, "fsdp2", info)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    res = wrapped.module(**batch(torch.float32), logits_to_keep=1, output_hidden_states=True)
    (res.hidden_states.float().pow(2).mean() + res.logits.float().sum()).backward()
    opt.step()
    params = sum(_local(p).nbytes for p in model.parameters())
    grads = sum(_local(p.grad).nbytes for p in model.parameters() if p.grad is not None)
    states = sum(_local(s[k]).nbytes for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{info.rank}.json").write_text(json.dumps({"params": params, "grads": grads, "states": states}))


if __name__ == "__main__":
    info = kdist.init_distributed("cpu")
    try:
        for arg in sys.argv[2:]:
            run(Path(sys.argv[1]) / arg, [] if arg == "-" else arg.split(","), info)
    finally:
        kdist.cleanup()
