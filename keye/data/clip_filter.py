"""CLIP-score filtering of image-text pairs (the data-quality filter of the Keye-VL reports).

The Keye reports keep image-caption pairs whose CLIP score is above a threshold and re-caption the rest.
Here a local open_clip checkpoint scores every *pair row* of a manifest (exactly one image and a non-empty
text), rows at or below the threshold are dropped, and the kept rows are written to a new manifest with a
``clip_score`` field. Rows that are not pairs (video, text-only, several images) pass through unchanged
unless ``drop_non_pairs``; rows whose image cannot be read are dropped and reported.

Scores: ``"cosine"`` is the cosine similarity of the L2-normalised image and text embeddings (in [-1, 1]);
``"clipscore"`` is ``2.5 * max(cosine, 0)`` (Hessel et al., 2021), the scale "score > 0.9" style thresholds
usually refer to.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from keye.data.manifest import BadRow, Sample, read_manifest, write_manifest
from keye.errors import KeyeConfigError, KeyeInputError

SCORES = ("cosine", "clipscore")
TEXT_FROM = ("assistant", "user", "all")


@dataclass
class ClipScorer:
    """An open_clip model, its eval preprocessing and tokenizer.

    Build with :meth:`load`; call :meth:`score` on aligned lists of PIL images and texts.
    """

    model: Any
    preprocess: Any
    tokenizer: Any
    device: str = "cpu"

    @classmethod
    def load(
        cls,
        model_name: str,
        checkpoint: str | os.PathLike[str] | None = None,
        *,
        model_config: str | os.PathLike[str] | None = None,
        device: str = "cpu",
    ) -> ClipScorer:
        """Load an open_clip model.

        Args:
            model_name: an open_clip architecture name (``"ViT-B-32"``), or ignored when ``model_config``
                is given (the config file's stem becomes the name).
            checkpoint: local weights file (``.pt`` / ``.bin`` / ``.safetensors`` state dict, or an open_clip
                pretrained tag already in the local cache). ``None`` keeps random weights (tests only).
            model_config: a JSON open_clip model config (``embed_dim``, ``vision_cfg``, ``text_cfg``).

        Raises:
            KeyeConfigError: unknown model name, unreadable config or checkpoint.
        """
        try:
            import open_clip
        except ImportError as err:  # pragma: no cover - open_clip_torch is in the "data" extra
            raise KeyeConfigError("CLIP filtering needs open_clip_torch: pip install 'keye[data]'") from err
        if model_config is not None:
            cfg = Path(model_config)
            if not cfg.is_file():
                raise KeyeConfigError(f"open_clip model config {cfg} not found")
            open_clip.add_model_config(cfg)
            model_name = cfg.stem
        if checkpoint is not None and not Path(checkpoint).exists():
            raise KeyeConfigError(f"CLIP checkpoint {checkpoint} not found (this filter never downloads weights)")
        try:
            model, _, preprocess = open_clip.create_model_and_transforms(
                model_name, pretrained=None if checkpoint is None else str(checkpoint), device=device
            )
            tokenizer = open_clip.get_tokenizer(model_name)
        except (RuntimeError, ValueError, KeyError, OSError) as err:
            raise KeyeConfigError(f"cannot build open_clip model {model_name!r}: {err}") from err
        model.eval()
        return cls(model, preprocess, tokenizer, device)

    @torch.no_grad()
    def cosine(self, images: list[Any], texts: list[str]) -> torch.Tensor:
        """Cosine similarity of each (image, text) pair; float32 ``[n]``."""
        if len(images) != len(texts):
            raise KeyeInputError(f"{len(images)} images but {len(texts)} texts")
        pix = torch.stack([self.preprocess(im) for im in images]).to(self.device)
        tok = self.tokenizer(texts).to(self.device)
        a = self.model.encode_image(pix).float()
        b = self.model.encode_text(tok).float()
        a = a / a.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        b = b / b.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return (a * b).sum(-1).cpu()

    def score(self, images: list[Any], texts: list[str], kind: str = "cosine") -> torch.Tensor:
        """Pair scores of the given ``kind`` (``"cosine"`` or ``"clipscore"``); float32 ``[n]``."""
        if kind not in SCORES:
            raise KeyeConfigError(f"unknown score {kind!r}; expected one of {SCORES}")
        cos = self.cosine(images, texts)
        return cos if kind == "cosine" else 2.5 * cos.clamp_min(0.0)


def pair_text(sample: Sample, text_from: str = "assistant") -> str:
    """The text side of a pair row: the assistant turns (the caption), the user turns, or all turns."""
    if text_from not in TEXT_FROM:
        raise KeyeConfigError(f"text_from must be one of {TEXT_FROM}, got {text_from!r}")
    parts: list[str] = []
    for m in sample.messages:
        if text_from != "all" and m["role"] != text_from:
            continue
        c = m["content"]
        if isinstance(c, str):
            parts.append(c)
        else:
            parts += [it["text"] for it in c if it.get("type") == "text"]
    return " ".join(p.strip() for p in parts if p.strip())


def rebase_row(row: dict[str, Any], sample: Sample, out_dir: Path) -> dict[str, Any]:
    """Copy of manifest ``row`` (parsed as ``sample``) whose relative media paths are rewritten to be relative
    to ``out_dir``; absolute paths, URLs and data URIs are kept."""
    row = dict(row)
    msgs = []
    for raw, parsed in zip(row["messages"], sample.messages):
        if isinstance(raw.get("content"), str):
            msgs.append(raw)
            continue
        items = []
        for r_item, p_item in zip(raw["content"], parsed["content"]):
            kind = p_item.get("type")
            if kind in ("image", "video") and isinstance(r_item, dict):
                val = r_item.get(kind)
                if isinstance(val, str) and not (val.startswith(("http://", "https://", "data:", "file://", "/"))):
                    r_item = {**r_item, kind: os.path.relpath(p_item[kind], out_dir)}
                elif isinstance(val, list):
                    r_item = {**r_item, kind: [os.path.relpath(v, out_dir) for v in p_item[kind]]}
            items.append(r_item)
        msgs.append({**raw, "content": items})
    row["messages"] = msgs
    return row


@dataclass
class FilterReport:
    """What :func:`clip_filter_manifest` did: counts, dropped/bad rows and the score list of scored pairs."""

    out_path: Path
    kept: int = 0
    dropped: int = 0
    passed_through: int = 0
    bad: list[BadRow] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)

    def format(self) -> str:
        """One-paragraph summary."""
        s = sorted(self.scores)
        q = (lambda p: s[min(len(s) - 1, int(p * len(s)))]) if s else (lambda p: float("nan"))
        return (
            f"scored {len(s)} pairs: kept {self.kept}, dropped {self.dropped} (score quartiles "
            f"{q(0.25):.3f} / {q(0.5):.3f} / {q(0.75):.3f}); passed through {self.passed_through} non-pair rows; "
            f"{len(self.bad)} bad rows; wrote {self.out_path}"
        )


def clip_filter_manifest(
    manifest: str | os.PathLike[str],
    out: str | os.PathLike[str],
    scorer: ClipScorer,
    *,
    threshold: float,
    root: str | os.PathLike[str] | None = None,
    score: str = "cosine",
    text_from: str = "assistant",
    drop_non_pairs: bool = False,
    batch_size: int = 64,
) -> FilterReport:
    """Score the manifest's image-text pairs and write the rows to keep to ``out``.

    A pair is kept when its score is strictly above ``threshold``. Kept rows get ``clip_score`` (rounded to
    6 decimals) and media paths re-written relative to ``out``'s directory.

    Returns:
        :class:`FilterReport`. Malformed rows and unreadable images are listed in ``bad`` and dropped.
    """
    from PIL import Image, UnidentifiedImageError

    man = read_manifest(manifest, root)
    out_p = Path(out)
    report = FilterReport(out_p, bad=list(man.bad_rows))
    decided: dict[int, float | None] = {}  # sample index -> score (None = pass through)
    pending: list[tuple[Sample, Any, str]] = []

    def flush() -> None:
        if not pending:
            return
        scores = scorer.score([p[1] for p in pending], [p[2] for p in pending], score)
        for (s, _, _), v in zip(pending, scores.tolist()):
            decided[s.index] = float(v)
            report.scores.append(float(v))
        pending.clear()

    for s in man.samples:
        text = pair_text(s, text_from)
        is_pair = len(s.media) == 1 and s.media[0].kind == "image" and s.media[0].frames is None and bool(text)
        if not is_pair:
            if not drop_non_pairs:
                decided[s.index] = None
            continue
        try:
            with Image.open(s.media[0].path) as im:
                img = im.convert("RGB")
        except (OSError, UnidentifiedImageError, ValueError) as err:
            report.bad.append(BadRow(s.line, f"cannot read image {s.media[0].path}: {err}", s.id))
            continue
        pending.append((s, img, text))
        if len(pending) >= batch_size:
            flush()
    flush()
    rows = []
    for s in man.samples:
        if s.index not in decided:
            continue
        v = decided[s.index]
        if v is None:
            report.passed_through += 1
            rows.append(rebase_row(s.row, s, out_p.parent.resolve()))
        elif v > threshold:
            report.kept += 1
            rows.append({**rebase_row(s.row, s, out_p.parent.resolve()), "clip_score": round(v, 6)})
        else:
            report.dropped += 1
    write_manifest(out_p, rows)
    report.bad.sort(key=lambda b: b.line)
    return report
