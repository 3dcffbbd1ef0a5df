"""Training data: manifests, media probing, cost model, load balancing, packing, the loader, the synthetic
video-QA set and CLIP-score filtering.

Public pieces: :func:`read_manifest` / :func:`check_manifest` (manifest.py), :func:`probe_media` and
:class:`ProbeCache` (probe.py), :class:`CostModel` / :class:`SampleCost` (cost.py), :func:`balance`
(balance.py), :func:`pack_ffd` / :func:`length_buckets` (packing.py), :class:`BalancedSampler`
(sampler.py), :func:`build_dataloader` / :class:`KeyeDataLoader` (loader.py), :class:`DataGroups` (groups.py:
data-parallel groups of ranks), :func:`estimate_parallel` (cost.py), :func:`generate` (synth.py).
CLIP filtering lives in :mod:`keye.data.clip_filter` (imports open_clip on use), the synthetic set's answer
check in :mod:`keye.data.synth_answers` and the resumable append-only JSONL of records in
:mod:`keye.data.records`.
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use: the loader and the probes pull in torch and the processor, and the evaluation
# package imports only light modules from here (manifest, synth_answers, records).
_LAZY = {
    "BadRow": "keye.data.manifest",
    "BalancedSampler": "keye.data.sampler",
    "CheckReport": "keye.data.manifest",
    "CostColumns": "keye.data.table",
    "CostModel": "keye.data.cost",
    "DataGroups": "keye.data.groups",
    "EpochPlan": "keye.data.sampler",
    "IndexTable": "keye.data.index",
    "KeyeDataLoader": "keye.data.loader",
    "Manifest": "keye.data.manifest",
    "ManifestTable": "keye.data.table",
    "MediaInfo": "keye.data.probe",
    "MediaRef": "keye.data.manifest",
    "ModelDims": "keye.data.cost",
    "ProbeCache": "keye.data.probe",
    "Sample": "keye.data.manifest",
    "SampleCost": "keye.data.cost",
    "SampleTable": "keye.data.table",
    "StepPlan": "keye.data.sampler",
    "balance": "keye.data.balance",
    "build_dataloader": "keye.data.loader",
    "build_index": "keye.data.index",
    "check_manifest": "keye.data.manifest",
    "check_source": "keye.data.check",
    "collate_packed": "keye.data.collate",
    "collate_padded": "keye.data.collate",
    "estimate_parallel": "keye.data.cost",
    "generate": "keye.data.synth",
    "generate_split": "keye.data.synth",
    "imbalance": "keye.data.balance",
    "length_buckets": "keye.data.packing",
    "llm_flops": "keye.data.cost",
    "lpt": "keye.data.balance",
    "pack_ffd": "keye.data.packing",
    "probe_file": "keye.data.probe",
    "probe_media": "keye.data.probe",
    "read_manifest": "keye.data.manifest",
    "split_into_bins": "keye.data.packing",
    "vision_flops": "keye.data.cost",
}


__all__ = [
    "BadRow",
    "BalancedSampler",
    "CheckReport",
    "CostColumns",
    "CostModel",
    "DataGroups",
    "EpochPlan",
    "IndexTable",
    "KeyeDataLoader",
    "Manifest",
    "ManifestTable",
    "MediaInfo",
    "MediaRef",
    "ModelDims",
    "ProbeCache",
    "Sample",
    "SampleCost",
    "SampleTable",
    "StepPlan",
    "balance",
    "build_dataloader",
    "build_index",
    "check_manifest",
    "check_source",
    "collate_packed",
    "collate_padded",
    "estimate_parallel",
    "generate",
    "generate_split",
    "imbalance",
    "length_buckets",
    "llm_flops",
    "lpt",
    "pack_ffd",
    "probe_file",
    "probe_media",
    "read_manifest",
    "split_into_bins",
    "vision_flops",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'keye.data' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
