"""A recording stand-in for the ``vllm`` package, with the interface :class:`keye.rl.VLLMRollout` uses.

``LLM(model=path)`` loads the checkpoint's weights (as vLLM builds its engine from the start checkpoint),
``apply_model(fn)`` calls ``fn`` on a model whose ``load_weights(iter of (name, tensor))`` replaces the held
weights (how :meth:`VLLMRollout.sync_weights` pushes the trainer's policy), and ``generate(requests, params)``
samples token ids from a generator seeded with ``params.seed`` and records, per call, a fingerprint of the
weights it holds at that moment and the seed: the tests compare those fingerprints with the trainer's
checkpoints. The sampled ids do not depend on the weights (no forward is run); they are ordinary vocabulary
ids ending in EOS when shorter than ``max_tokens``, or only ``<|video_pad|>`` ids (text tokens a policy may
sample, which are scored but never enter the loss) for the ranks listed in the environment variable
``FAKE_VLLM_PLACEHOLDER_RANKS`` or the call numbers in :attr:`LLM.placeholder_calls`; the ranks listed in
``FAKE_VLLM_FAIL_RANKS`` raise instead of generating (a rank that fails while the others wait).

:func:`install` puts the module into ``sys.modules["vllm"]`` so ``import vllm`` finds it (tests register the
result of :func:`reset` with ``monkeypatch.setitem(sys.modules, "vllm", ...)`` instead).
"""

from __future__ import annotations

import os
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch


def fingerprint(state: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per-parameter float64 sums: equal for equal weights, different after any optimizer update."""
    return {k: float(v.detach().double().sum()) for k, v in sorted(state.items())}


@dataclass
class SamplingParams:
    """The fields :meth:`VLLMRollout.generate` sets."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    logprobs: int | None = None


@dataclass
class _Completion:
    token_ids: list[int]
    text: str
    logprobs: Any
    finish_reason: str


@dataclass
class _RequestOutput:
    outputs: list[_Completion]


class _Model:
    def __init__(self, llm: LLM):
        self.llm = llm

    def load_weights(self, weights: Any) -> None:
        for name, tensor in weights:
            if name not in self.llm.weights:
                raise KeyError(f"unknown parameter {name!r}")
            self.llm.weights[name] = tensor.detach().clone()
        self.llm.loads += 1


class LLM:
    """Holds a copy of the weights; records what it holds at every ``generate``."""

    instances: list[LLM] = []
    placeholder_calls: set[int] = set()

    def __init__(self, model: str, **kwargs: Any):
        from keye import KeyeVL
        from keye.processing.processor import KeyeProcessor

        core = KeyeVL.from_pretrained(model, torch_dtype="float32")
        self.weights = {k: v.detach().clone() for k, v in core.state_dict().items()}
        self.processor = KeyeProcessor.from_pretrained(model)
        self.eos = int(core.config.eos_token_ids[0])
        self.placeholder = int(core.config.video_token_id)
        self.loads = 0
        self.generations: list[dict[str, Any]] = []
        rank = os.environ.get("RANK", "0")
        self.placeholder_only = rank in os.environ.get("FAKE_VLLM_PLACEHOLDER_RANKS", "").split(",")
        LLM.instances.append(self)

    def apply_model(self, fn: Any) -> list[Any]:
        return [fn(_Model(self))]

    def reset_prefix_cache(self) -> None:
        pass

    def generate(self, requests: list[dict[str, Any]], params: SamplingParams, use_tqdm: bool = True
                 ) -> list[_RequestOutput]:
        if os.environ.get("RANK", "0") in os.environ.get("FAKE_VLLM_FAIL_RANKS", "").split(","):
            raise RuntimeError("fake vLLM engine failure on this rank")
        call = len(self.generations)
        self.generations.append({"weights": fingerprint(self.weights), "seed": params.seed,
                                 "prompts": len(requests)})
        gen = torch.Generator().manual_seed(int(params.seed))
        placeholder = self.placeholder_only or call in LLM.placeholder_calls
        outs = []
        for _ in requests:
            comps = []
            for _ in range(params.n):
                k = int(torch.randint(1, params.max_tokens + 1, (1,), generator=gen))
                if placeholder:
                    ids = [self.placeholder] * k
                else:
                    ids = torch.randint(3, 470, (k,), generator=gen).tolist()
                    if k < params.max_tokens:
                        ids[-1] = self.eos
                finish = "stop" if ids[-1] == self.eos else "length"
                comps.append(_Completion(ids, self.processor.decode(ids, skip_special_tokens=True), None, finish))
            outs.append(_RequestOutput(comps))
        return outs


def reset() -> types.ModuleType:
    """Forget the recorded engines and placeholder calls; returns this module (to register as ``vllm``)."""
    LLM.instances = []
    LLM.placeholder_calls = set()
    return sys.modules[__name__]


def install() -> types.ModuleType:
    """Register this module as ``vllm`` for the rest of the process (scripts; tests use monkeypatch)."""
    sys.modules["vllm"] = reset()
    return sys.modules["vllm"]
