"""Checkpoint files: resolving a hub id or local directory, reading (sharded) safetensors, writing
them back in the official layout (``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` plus
``model.safetensors.index.json``)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from keye.errors import KeyeWeightsError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# Official tensors the forward pass never reads: the SigLIP attention-pooling head, the packing
# position table and any stored rotary caches. They are accepted and dropped.
IGNORED_KEY_PATTERNS = (
    re.compile(r"^visual\.vision_model\.head\."),
    re.compile(r"^visual\.vision_model\.embeddings\.packing_position_embedding\.weight$"),
    re.compile(r"\.rotary_emb\.inv_freq$"),
)


def is_ignored_key(name: str) -> bool:
    """True for official checkpoint tensors that keye deliberately does not load."""
    return any(p.search(name) for p in IGNORED_KEY_PATTERNS)


def resolve_checkpoint(
    name_or_path: str | os.PathLike, *, revision: str | None = None, cache_dir: str | None = None
) -> Path:
    """A local directory for ``name_or_path``: the directory itself, or a hub snapshot.

    Hub ids (``"Kwai-Keye/Keye-VL-1_5-8B"``) are fetched with ``huggingface_hub`` (configs, tokenizer
    files and safetensors only; the official remote code is not needed). Offline, a cached snapshot is
    used; with no cache, :class:`KeyeWeightsError` explains how to pass a local directory.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise KeyeWeightsError(f"{path}: expected a checkpoint directory, got a file")
    name = str(name_or_path)
    if name.count("/") != 1 or name.startswith((".", "/")):
        raise KeyeWeightsError(f"{name}: no such directory, and not a hub id of the form 'org/name'")
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            repo_id=name,
            revision=revision,
            cache_dir=cache_dir,
            allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken"],
        )
    except Exception as err:  # noqa: BLE001 - every hub failure gets the same actionable message
        raise KeyeWeightsError(
            f"{name}: could not fetch from the Hugging Face hub ({type(err).__name__}: {err}). "
            "If you are offline, download the checkpoint elsewhere and pass its local directory."
        ) from None
    return Path(local)


def checkpoint_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, in index order."""
    index = directory / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise KeyeWeightsError(f"{index}: not a valid safetensors index ({err})") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (directory / f).is_file()]
        if missing:
            raise KeyeWeightsError(f"{index}: lists shard(s) that do not exist: {', '.join(missing)}")
        return [directory / f for f in files]
    single = directory / SINGLE_NAME
    if single.is_file():
        return [single]
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise KeyeWeightsError(f"{directory}: no model.safetensors, no {INDEX_NAME} and no *.safetensors files")
    return shards


def iter_tensors(directory: Path) -> Iterator[tuple[str, Path, object]]:
    """Yield (name, file, safe_open handle) for every tensor of the checkpoint without loading it."""
    for file in checkpoint_files(directory):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, file, f
        except KeyeWeightsError:
            raise
        except Exception as err:  # noqa: BLE001 - corrupt/truncated file
            raise KeyeWeightsError(f"{file}: cannot read safetensors ({err})") from None


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", size.upper())
    if not m:
        raise ValueError(f"cannot parse shard size {size!r} (use e.g. '5GB' or a byte count)")
    unit = m.group(2)
    mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
            "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(m.group(1)) * mult)


def save_state_dict(state: dict[str, torch.Tensor], directory: Path, max_shard_size: int | str = "5GB") -> list[Path]:
    """Write ``state`` as safetensors shards in the official layout; returns the files written.

    One file (``model.safetensors``) when everything fits in ``max_shard_size``; otherwise numbered
    shards and ``model.safetensors.index.json`` with ``metadata.total_size`` and ``weight_map``.
    """
    directory.mkdir(parents=True, exist_ok=True)
    limit = _parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and sizes[-1] + nbytes > limit:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = tensor.detach().to("cpu").contiguous()
        sizes[-1] += nbytes
    # Stale shards from an earlier save with another layout would confuse loaders.
    for old in list(directory.glob("model*.safetensors")) + [directory / INDEX_NAME]:
        if old.exists():
            old.unlink()
    meta = {"format": "pt"}
    if len(shards) == 1:
        path = directory / SINGLE_NAME
        save_file(shards[0], str(path), metadata=meta)
        return [path]
    n = len(shards)
    weight_map = {}
    files = []
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(directory / fname), metadata=meta)
        weight_map.update({k: fname for k in shard})
        files.append(directory / fname)
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return files
