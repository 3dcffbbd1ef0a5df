"""Run under ``torchrun --nproc_per_node 2`` by tests/data/test_elastic.py (gloo, CPU): the loader's elastic
resume (2 ranks -> 1, 1 -> 2, mid-epoch) and a 2-rank data-parallel group against the 1-process loader.

Arguments: manifest, out_json. Rank 0 writes every rank's record (gathered) as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from keye.data.loader import build_dataloader  # noqa: E402
from tests.data._elastic import TextCost, TextProcessor, fingerprint  # noqa: E402

KW = dict(batch_tokens=600, micro_batches=2, seed=4, num_workers=0, cost_model=TextCost())


def loader(manifest: str, proc: TextProcessor | None = None, **kw):
    """``build_dataloader`` over the text set; explicit ``world_size`` / ``rank`` make a loader of its own
    (no collectives), else the torchrun world is used."""
    return build_dataloader(manifest, proc or TextProcessor(), **{**KW, **kw})


def take(it, k: int) -> list:
    return [next(it)["sample_ids"] for _ in range(k)]


def main() -> None:
    manifest, out = sys.argv[1:3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rec: dict = {"rank": rank}
    try:
        # 2 ranks -> 1: both ranks train 3 micro-batches, rank 0's state resumes on a 1-rank loader.
        two = loader(manifest)
        it = iter(two)
        rec["two_first"] = take(it, 3)
        state = two.state_dict()
        if rank == 0:
            one = loader(manifest, world_size=1, rank=0)
            one.load_state_dict(state)
            rec["one_rest"] = [b["sample_ids"] for b in one]
            rec["one_next_epoch"] = [b["sample_ids"] for b in one]
            fresh = loader(manifest, world_size=1, rank=0)
            fresh.set_epoch(1)
            rec["fresh_epoch1"] = [b["sample_ids"] for b in fresh]
        it.close()
        # 1 rank -> 2: a 1-rank loader (on each process alike) trains 3 micro-batches, both ranks resume from it.
        one = loader(manifest, world_size=1, rank=0)
        it = iter(one)
        rec["one_first"] = take(it, 3)
        state = one.state_dict()
        it.close()
        two = loader(manifest)
        two.load_state_dict(state)
        rec["two_rest"] = [b["sample_ids"] for b in two]
        # One data-parallel group of both ranks: rank 0 reads, rank 1 receives; the 1-process loader as reference.
        proc = TextProcessor()
        grouped = loader(manifest, proc, group_size=2)
        it = iter(grouped)
        rec["group"] = [fingerprint(next(it)) for _ in range(2)]
        state = grouped.state_dict()
        rec["group"] += [fingerprint(b) for b in it]
        rec["group_reads"] = proc.calls
        rec["group_len"] = len(grouped.epoch_plan().rank_micro_batches(0))
        if rank == 1:  # the receiving rank's state resumes a 1-process loader exactly
            resumed = loader(manifest, world_size=1, rank=0)
            resumed.load_state_dict(state)
            rec["group_resumed"] = [fingerprint(b) for b in resumed]
        # The same with the reader decoding in a prefetching worker process.
        rec["group_workers"] = [fingerprint(b) for b in loader(manifest, group_size=2, num_workers=1)]
        if rank == 0:
            rec["single"] = [fingerprint(b) for b in loader(manifest, world_size=1, rank=0)]
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rec)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
