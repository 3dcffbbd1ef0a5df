"""Training data: manifests, media probing, cost model, load balancing, packing, the loader, the synthetic
video-QA set and CLIP-score filtering.

Public pieces: :func:`read_manifest` / :func:`check_manifest` (manifest.py), :func:`probe_media` and
:class:`ProbeCache` (probe.py), :class:`CostModel` / :class:`SampleCost` (cost.py), :func:`balance`
(balance.py), :func:`pack_ffd` / :func:`length_buckets` (packing.py), :class:`BalancedSampler`
(sampler.py), :func:`build_dataloader` / :class:`KeyeDataLoader` (loader.py), :func:`generate` (synth.py).
CLIP filtering lives in :mod:`keye.data.clip_filter` (imports open_clip on use).
"""

from __future__ import annotations

from keye.data.balance import balance, imbalance, lpt
from keye.data.collate import collate_packed, collate_padded
from keye.data.cost import CostModel, ModelDims, SampleCost, llm_flops, vision_flops
from keye.data.loader import KeyeDataLoader, build_dataloader
from keye.data.manifest import BadRow, CheckReport, Manifest, MediaRef, Sample, check_manifest, read_manifest
from keye.data.packing import length_buckets, pack_ffd, split_into_bins
from keye.data.probe import MediaInfo, ProbeCache, probe_file, probe_media
from keye.data.sampler import BalancedSampler, EpochPlan, StepPlan
from keye.data.synth import generate, generate_split

__all__ = [
    "BadRow",
    "BalancedSampler",
    "CheckReport",
    "CostModel",
    "EpochPlan",
    "KeyeDataLoader",
    "Manifest",
    "MediaInfo",
    "MediaRef",
    "ModelDims",
    "ProbeCache",
    "Sample",
    "SampleCost",
    "StepPlan",
    "balance",
    "build_dataloader",
    "check_manifest",
    "collate_packed",
    "collate_padded",
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
