"""Run under ``torchrun --nproc_per_node 2`` by tests/data/test_index.py (gloo, CPU).

Each rank builds the loader over an index folder (stored costs, world size / rank from torch.distributed), takes
one epoch of micro-batches and the ids of the samples its process read from the index; rank 0 writes every
rank's result as JSON to argv[4]. Arguments: index_dir, processor_dir, cache_path, out_json.
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from keye.data.index import IndexTable
from keye.data.loader import build_dataloader
from keye.data.probe import ProbeCache
from keye.processing.processor import KeyeProcessor


def main() -> None:
    index, proc_dir, cache_path, out = sys.argv[1:5]
    dist.init_process_group("gloo")
    try:
        read: list[int] = []
        real = IndexTable.sample
        IndexTable.sample = lambda self, i: (read.append(i), real(self, i))[1]  # what this rank materialises
        proc = KeyeProcessor.from_pretrained(proc_dir)
        dl = build_dataloader(index, proc, batch_tokens=2048, micro_batches=2, num_workers=0, seed=6,
                              probe_cache=ProbeCache(cache_path), cost_workers=0)
        batches = [[b["sample_ids"], int(b["input_ids"].sum())] for b in dl]
        mine = {"rank": dist.get_rank(), "world": dl.sampler.world_size, "batches": batches, "read": sorted(read),
                "stored": dl.costs.objects is None}
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(gathered, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
