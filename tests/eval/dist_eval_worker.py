"""Run under ``torchrun --nproc-per-node 2`` by tests/eval/test_distributed.py (gloo, CPU).

Each rank answers its shard of 7 items with a canned engine through ``run_inference`` (rank and world size
from torch.distributed); rank 0 gathers the part files. Every rank writes what ``run_inference`` returned to
``<out_dir>/returned.rank<r>.json``. Argument: out_dir.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from keye.eval.runner import init_distributed, run_inference


class RankEngine:
    def __init__(self, rank: int):
        self.rank = rank

    def generate(self, conversations, **kwargs):
        return [f"rank {self.rank}: {c[0]['content']}" for c in conversations]


def main() -> None:
    out_dir = Path(sys.argv[1])
    rank, world = init_distributed()
    try:
        items = [{"id": f"q{i}", "text": f"question {i}"} for i in range(7)]
        records = run_inference(
            items,
            engine=RankEngine(rank),
            to_conversation=lambda it: [{"role": "user", "content": it["text"]}],
            to_record=lambda it, raw, resp: {"id": it["id"], "raw_output": raw, "response": resp},
            out_path=out_dir / "predictions.jsonl",
            batch_size=2,
            progress=False,
        )
        (out_dir / f"returned.rank{rank}.json").write_text(json.dumps({"world": world, "records": records}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
