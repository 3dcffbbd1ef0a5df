"""The data side of an SFT run: the manifest as a load-balanced, resumable loader, with multi-answer rows turned
into shared-prefix trees when the manifest has them (or ``train.tree: on``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from keye.sft.config import SFTConfig
from keye.sft.trees import TreeCostModel, TreeSampleProcessor
from keye.train import dist as kdist


def build_sft_loader(cfg: SFTConfig, processor: Any, model_config: Any, info: kdist.DistInfo, out_dir: Path) -> Any:
    """This rank's :func:`keye.data.loader.build_dataloader` over ``data.manifest``: cost-balanced micro-batches of
    ``data.batch_tokens`` (packed) or ``data.batch_size`` samples, ``data.micro_batches`` per step, bad samples
    skipped and listed in ``bad_samples.jsonl`` (main rank). Rows carry their prefix trees when the manifest has
    multi-answer rows or ``train.tree`` is ``on``; micro-batches are then planned with the cost of the layout that
    runs (the tree's, or the expanded rows' for ``off``).

    With ``train.context_parallel`` = N the data-parallel groups are N consecutive ranks
    (:func:`keye.train.context_parallel.context_parallel_layout`): every rank of a group yields the same micro-batches,
    read by the group's first rank and sent to the others (``build_dataloader(group_size=N)``)."""
    from keye.data.cost import CostModel
    from keye.data.loader import build_dataloader
    from keye.data.table import has_multi_answer_rows, open_table

    manifest = open_table(cfg.data.manifest, cfg.data.root)  # a JSONL file, or an index folder (keye data index)
    tree_mode = cfg.train.tree
    loader_processor, cost_model = processor, None
    if tree_mode == "on" or has_multi_answer_rows(manifest):
        loader_processor = TreeSampleProcessor(processor, model_config)
        cost_model = TreeCostModel(CostModel.from_processor(processor, mode=cfg.data.processor_kwargs.get("mode")),
                                   shared=tree_mode != "off")
    d = cfg.data
    return build_dataloader(
        manifest, loader_processor, batch_tokens=d.batch_tokens, batch_size=d.batch_size, micro_batches=d.micro_batches,
        world_size=info.world_size, rank=info.rank, group_size=cfg.train.context_parallel, seed=cfg.train.seed,
        num_workers=d.num_workers, packing=d.packing,
        max_bad_fraction=d.max_bad_fraction, processor_kwargs=d.processor_kwargs,
        bad_log=(out_dir / "bad_samples.jsonl") if info.is_main else None, cost_model=cost_model)


__all__ = ["build_sft_loader"]
