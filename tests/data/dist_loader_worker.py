"""Run under ``torchrun --nproc_per_node N`` by tests/data/test_distributed.py (gloo, CPU).

Each rank builds the loader with world size / rank taken from torch.distributed, iterates two epochs, and
the per-rank sample ids are gathered to rank 0, which writes them as JSON to argv[4].
Arguments: manifest, processor_dir, cache_path, out_json.
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from keye.data.cost import CostModel
from keye.data.loader import build_dataloader
from keye.data.probe import ProbeCache
from keye.processing.processor import KeyeProcessor


def main() -> None:
    manifest, proc_dir, cache_path, out = sys.argv[1:5]
    dist.init_process_group("gloo")
    try:
        proc = KeyeProcessor.from_pretrained(proc_dir)
        dl = build_dataloader(
            manifest, proc, batch_tokens=4096, num_workers=0, seed=2,
            cost_model=CostModel(proc, cache=ProbeCache(cache_path)),
        )
        # Costs were estimated half on each rank and exchanged: every rank must hold the full, same list.
        tokens = [c.tokens for c in dl.costs]
        mine = {"rank": dist.get_rank(), "world": dl.sampler.world_size, "epochs": [], "tokens": tokens}
        for _ in range(2):
            ids = [batch["sample_ids"] for batch in dl]
            mine["epochs"].append(ids)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(gathered, f)
        # Both ranks leave together: a rank tearing down while the other (or rank 0's store) is still
        # talking to it can abort in the C++ store client.
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
