"""A recording stand-in for the ``vllm`` package, with the interface and behaviour :class:`keye.rl.VLLMRollout`
relies on, for CPU tests.

What it mimics (vLLM >= 0.10, V1 engine):

* ``LLM(model=path, enable_sleep_mode=False, logprobs_mode="raw_logprobs", ...)`` loads the checkpoint (a
  float32 :class:`keye.KeyeVL`) and its processor, as vLLM builds its engine from the start checkpoint.
* ``generate(prompts, sampling_params, use_tqdm=...)`` takes vLLM's prompt dicts ``{"prompt": text,
  "multi_modal_data": {"image": [PIL], "video": [uint8 [T, H, W, 3]]}, "mm_processor_kwargs": {...}}`` and
  processes them the way vLLM's Keye processors do: the text is tokenised, each ``<|image_pad|>`` /
  ``<|video_pad|>`` (one per item, as the chat template writes them) is replaced by the item's tokens
  (1.5 videos: ``<|frame|>`` + the ``.1f`` timestamp + pads, fast frames inside ``<|fast_start|>`` ...
  ``<|fast_end|>``, as ``KeyeVL1_5MultiModalProcessor._get_prompt_updates``), the images / frames go through
  the checkpoint's image processor (1.5: slow and fast frames resized to the sizes in the kwargs; preview:
  ``second_per_grid_ts`` from the ``fps`` kwarg, 2.0 when absent as in the HF processors). Child ``j`` of a
  request draws from a generator seeded ``seed + j`` (vLLM's parallel-sampling rule). With
  ``LLM.sampler = "model"`` it samples from the *held weights* (``KeyeVL.generate_steps``: temperature, top-k,
  top-p, stop ids); with ``"random"`` (the default, which the RL scale tests were written against: responses
  of varied length and format from a tiny random model) the token ids are ordinary ids of a random length,
  ending in EOS when shorter than ``max_tokens``. Either way ``RequestOutput`` / ``CompletionOutput`` objects
  come back whose ``logprobs`` hold one ``{token_id: Logprob}`` per step, computed with the held weights:
  under the raw logits (``raw_logprobs``, vLLM's default) or under the tempered, top-k/top-p filtered
  distribution (``processed_logprobs``).
* Weights: ``apply_model(fn)`` calls ``fn(model)`` on a pickled copy of ``fn`` (vLLM V1 serialises it to its
  worker process); with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the model is also reachable in process as
  ``llm.llm_engine.model_executor.driver_worker.worker.model_runner.model``. Its ``load_weights(iterable of
  (name, tensor))`` copies into the held weights in place and fails like vLLM's loader: an unknown name raises
  ``ValueError`` ("There is no module or parameter named ..."), a wrong shape an ``AssertionError``.
* Sleep mode: ``sleep(level)`` needs ``enable_sleep_mode=True``; level 1 keeps the weights (offloaded), level 2
  discards them; ``wake_up(tags=None | ["weights"] | ["kv_cache"])``. Generating while anything sleeps, or
  loading weights while the weights sleep, raises; so does generating with weights discarded and not reloaded.

It records everything a test checks: ``calls`` (every generate / sleep / wake_up / load / prefix-cache reset in
order), ``weight_loads`` (the names of each ``load_weights`` call and which path it came through),
``generations`` (per ``generate``: a fingerprint of the weights held, the seed of each prompt, the prompt count) and
``requests`` (per processed request: the prompt ids and vision tensors it became).

Test hooks of the RL scale tests: the ranks listed in the environment variable ``FAKE_VLLM_PLACEHOLDER_RANKS``
or the call numbers in :attr:`LLM.placeholder_calls` sample only ``<|video_pad|>`` ids (text tokens a policy
may sample, which are scored but never enter the loss) of random length, without running the model; the ranks
in ``FAKE_VLLM_FAIL_RANKS`` raise instead of generating (a rank that fails while the others wait).

:func:`install` puts the module into ``sys.modules["vllm"]`` so ``import vllm`` finds it (tests register the
result of :func:`reset` with ``monkeypatch.setitem(sys.modules, "vllm", ...)`` instead).
"""

from __future__ import annotations

import os
import pickle
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


def fingerprint(state: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per-parameter float64 sums: equal for equal weights, different after any optimizer update."""
    return {k: float(v.detach().double().sum()) for k, v in sorted(state.items())}


@dataclass
class EngineArgs:
    """The engine-argument fields the rollout looks for (``logprobs_mode`` exists from vLLM 0.10.2)."""

    model: str = ""
    enable_sleep_mode: bool = False
    logprobs_mode: str = "raw_logprobs"


@dataclass
class SamplingParams:
    """vLLM's sampling parameters (the fields :class:`VLLMRollout` sets; ``top_k`` -1 or 0 = off)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 16
    seed: int | None = None
    logprobs: int | None = None
    stop_token_ids: list[int] | None = None


@dataclass
class Logprob:
    """vLLM's per-token log-prob record."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sampled sequence of a request (vLLM's field names)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """The outputs of one request (vLLM's field names)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool = True


class _Model:
    """The worker-side model: ``load_weights`` as vLLM's Keye models (official names in, loaded names out)."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.via = "direct"

    def load_weights(self, weights: Any) -> set[str]:
        llm = self.llm
        if "weights" in llm.sleeping:
            raise RuntimeError("fake vLLM: load_weights while the weights are asleep (wake_up(tags=['weights']) first)")
        held = llm.weights
        items = list(weights)
        for name, tensor in items:
            if name not in held:
                raise ValueError(f"There is no module or parameter named '{name}' in KeyeForConditionalGeneration")
            assert held[name].shape == tensor.shape, (
                f"Attempted to load weight ({tensor.shape}) into parameter ({held[name].shape})")
        with torch.no_grad():
            for name, tensor in items:
                held[name].copy_(tensor)
                llm.discarded.discard(name)
        names = [n for n, _ in items]
        llm.weight_loads.append({"names": names, "via": self.via})
        llm.calls.append(("load_weights", len(names)))
        return set(names)


@dataclass
class _Chain:
    """Attribute chains of a constructed LLM (``llm_engine.model_config.model``, the in-process executor)."""

    model: Any = None
    worker: Any = None
    model_runner: Any = None
    driver_worker: Any = None
    model_executor: Any = None
    model_config: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


class LLM:
    """Runs the checkpoint's KeyeVL; records requests, generations, sleeps and weight loads."""

    instances: list[LLM] = []
    placeholder_calls: set[int] = set()
    sampler: str = "random"

    def __init__(self, model: str, *, enable_sleep_mode: bool = False, logprobs_mode: str = "raw_logprobs",
                 **kwargs: Any):
        from keye import KeyeVL
        from keye.processing.processor import KeyeProcessor

        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.model = KeyeVL.from_pretrained(model, torch_dtype="float32").eval()
        self.processor = KeyeProcessor.from_pretrained(model)
        self.kwargs = dict(kwargs, enable_sleep_mode=enable_sleep_mode, logprobs_mode=logprobs_mode)
        self.enable_sleep_mode = enable_sleep_mode
        self.logprobs_mode = logprobs_mode
        self.eos = [int(e) for e in self.model.config.eos_token_ids]
        self.placeholder = int(self.model.config.video_token_id)
        self.weight_loads: list[dict[str, Any]] = []
        self.calls: list[tuple[Any, ...]] = []
        self.generations: list[dict[str, Any]] = []
        self.requests: list[dict[str, Any]] = []
        self.sleeping: set[str] = set()
        self.discarded: set[str] = set()
        rank = os.environ.get("RANK", "0")
        self.placeholder_only = rank in os.environ.get("FAKE_VLLM_PLACEHOLDER_RANKS", "").split(",")
        in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
        worker_model = _Model(self)
        runner = _Chain(model=worker_model)
        executor = _Chain(driver_worker=_Chain(worker=_Chain(model_runner=runner)))
        self.llm_engine = _Chain(model_config=_Chain(model=str(model)), model_executor=executor if in_process else None)
        LLM.instances.append(self)

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """The weights the engine holds now (the live tensors)."""
        return self.model.state_dict()

    # ------------------------------------------------------------------------------------------ weights
    def apply_model(self, func: Any) -> list[Any]:
        func = pickle.loads(pickle.dumps(func))  # what crossing to the worker process requires
        model = _Model(self)
        model.via = "apply_model"
        return [func(model)]

    def reset_prefix_cache(self) -> bool:
        self.calls.append(("reset_prefix_cache",))
        return True

    # ------------------------------------------------------------------------------------------- sleep
    def sleep(self, level: int = 1) -> None:
        if not self.enable_sleep_mode:
            raise RuntimeError("Sleep mode is not enabled. Enable it with enable_sleep_mode=True.")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self.calls.append(("sleep", level))
        self.sleeping = {"weights", "kv_cache"}
        if level == 2:
            self.discarded = set(self.weights)

    def wake_up(self, tags: list[str] | None = None) -> None:
        if tags is not None and not set(tags) <= {"weights", "kv_cache"}:
            raise ValueError(f"unknown wake_up tags {tags}")
        self.calls.append(("wake_up", None if tags is None else tuple(tags)))
        self.sleeping -= {"weights", "kv_cache"} if tags is None else set(tags)

    # -------------------------------------------------------------------------------------- processing
    def _vision(self, ids: list[int], req: dict[str, Any]) -> tuple[list[int], dict[str, torch.Tensor]]:
        """Expand the placeholders of ``ids`` and process the media, as vLLM's Keye processor does."""
        from keye.processing.slowfast import resize_frames

        proc = self.processor
        tok = proc.tokenizer
        mm = req.get("multi_modal_data") or {}
        unknown = sorted(set(mm) - {"image", "video"})
        if unknown:
            raise ValueError(f"Keye accepts image and video data, got {unknown}")
        kw = req.get("mm_processor_kwargs") or {}
        images = mm.get("image", [])
        images = images if isinstance(images, list) else [images]
        videos = mm.get("video", [])
        videos = videos if isinstance(videos, list) else [videos]
        img_id, vid_id = proc.image_token_id, proc.video_token_id
        for name, pid, items in (("image", img_id, images), ("video", vid_id, videos)):
            if ids.count(pid) != len(items):
                raise ValueError(f"Expected there to be {len(items)} prompt updates corresponding to {len(items)} "
                                 f"{name} items, but instead found {ids.count(pid)} prompt updates")
        if proc.variant != "preview" and len(videos) > 1:
            raise ValueError(f"At most 1 video(s) may be provided in one prompt, got {len(videos)}")
        merge2 = proc.image_processor.config.merge_size ** 2
        out: list[int] = []
        pv_img, grid_img, pv_vid, grid_vid, secs = [], [], [], [], []
        n_img = n_vid = 0
        for t in ids:
            if t == img_id:
                img = images[n_img]
                n_img += 1
                pv, grid = proc.image_processor(img)
                pv_img.append(pv)
                grid_img.append(grid)
                out += [img_id] * (grid[0] * grid[1] * grid[2] // merge2)
            elif t == vid_id:
                frames = np.asarray(videos[n_vid])
                k, n_vid = n_vid, n_vid + 1
                if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
                    raise ValueError(f"video {k}: expected uint8 frames [T, H, W, 3], got {frames.dtype} "
                                     f"{frames.shape}")
                if proc.variant == "preview":
                    pv, grid = proc.image_processor.preprocess_frames(frames)
                    pv_vid.append(pv)
                    grid_vid.append(grid)
                    secs.append(1.0 / float(kw.get("fps", [2.0] * len(videos))[k]))
                    out += [vid_id] * (grid[0] * grid[1] * grid[2] // merge2)
                    continue
                x = torch.from_numpy(frames).permute(0, 3, 1, 2)
                types = kw.get("frame_types", [None] * len(videos))[k]
                types = torch.zeros(len(x), dtype=torch.long) if types is None else torch.as_tensor(types).long()
                stamps = kw.get("timestamps", [None] * len(videos))[k]
                parts = {}
                for kind, keys in ((0, ("height", "width")), (1, ("fast_height", "fast_width"))):
                    sel = types == kind
                    if not bool(sel.any()):
                        continue
                    if all(key in kw for key in keys):
                        hw = (int(kw[keys[0]][k]), int(kw[keys[1]][k]))
                        pv, grid = proc.image_processor.preprocess_resized(resize_frames(x[sel], hw))
                    else:  # no sizes given: the image processor's own resize (spec §10.5)
                        pv, grid = proc.image_processor.preprocess_frames(frames[sel.numpy()])
                    parts[kind] = (pv, grid[1], grid[2], iter(range(int(sel.sum()))))
                rows = []
                for j, kind in enumerate(types.tolist()):
                    pv, h, w, order = parts[kind]
                    i = next(order)
                    pv_vid.append(pv[i * h * w:(i + 1) * h * w])
                    rows.append([1, h, w])
                    s = "<|frame|>" + ("" if stamps is None else format(float(stamps[j]), ".1f"))
                    if kind == 1:
                        s += "<|fast_start|>"
                    out += list(tok(s, add_special_tokens=False)["input_ids"]) + [vid_id] * (h * w // merge2)
                    if kind == 1:
                        out.append(proc.token_ids["<|fast_end|>"])
                merged: list[list[int]] = []  # the processor's merge_thw: runs of equal frame grids, one row each
                for row in rows:
                    if merged and merged[-1][1:] == row[1:]:
                        merged[-1][0] += 1
                    else:
                        merged.append(list(row))
                grid_vid += merged
            else:
                out.append(t)
        vision: dict[str, torch.Tensor] = {}
        if pv_img:
            vision["pixel_values"] = torch.cat(pv_img)
            vision["image_grid_thw"] = torch.tensor(grid_img, dtype=torch.long)
        if pv_vid:
            vision["pixel_values_videos"] = torch.cat(pv_vid)
            vision["video_grid_thw"] = torch.tensor(grid_vid, dtype=torch.long)
            if proc.variant == "preview":
                vision["second_per_grid_ts"] = torch.tensor(secs, dtype=torch.float32)
        return out, vision

    def _prompt(self, req: Any) -> tuple[str | None, list[int], dict[str, torch.Tensor]]:
        if isinstance(req, str):
            req = {"prompt": req}
        if not isinstance(req, dict) or ("prompt" in req) == ("prompt_token_ids" in req):
            raise ValueError("a prompt is a str, or a dict with exactly one of 'prompt' / 'prompt_token_ids'")
        extra = sorted(set(req) - {"prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs"})
        if extra:
            raise ValueError(f"unexpected prompt keys {extra}")
        if "prompt" in req:
            ids = list(self.processor.tokenizer(req["prompt"], add_special_tokens=False)["input_ids"])
        else:
            ids = [int(t) for t in req["prompt_token_ids"]]
        ids, vision = self._vision(ids, req)
        self.requests.append({"prompt_token_ids": ids, **vision})
        return req.get("prompt"), ids, vision

    # --------------------------------------------------------------------------------------- generation
    def generate(self, prompts: Any, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, lora_request: Any = None) -> list[RequestOutput]:
        del use_tqdm, lora_request
        if os.environ.get("RANK", "0") in os.environ.get("FAKE_VLLM_FAIL_RANKS", "").split(","):
            raise RuntimeError("fake vLLM engine failure on this rank")
        if self.sleeping:
            raise RuntimeError(f"fake vLLM: generate while {sorted(self.sleeping)} sleep(s); wake_up() first")
        if self.discarded:
            raise RuntimeError(f"fake vLLM: generate with {len(self.discarded)} weights discarded by a level-2 sleep "
                               "and never reloaded")
        prompts = prompts if isinstance(prompts, list) else [prompts]
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"The lengths of prompts ({len(prompts)}) and sampling_params ({len(params_list)}) must "
                             "be the same.")
        params_list = [p or SamplingParams() for p in params_list]
        call = len(self.generations)
        self.calls.append(("generate", len(prompts)))
        self.generations.append({"weights": fingerprint(self.weights), "seed": [p.seed for p in params_list],
                                 "prompts": len(prompts)})
        placeholder = self.placeholder_only or call in LLM.placeholder_calls
        outs = []
        for r, (req, params) in enumerate(zip(prompts, params_list)):
            text, ids, vision = self._prompt(req)
            base = int(params.seed) if params.seed is not None else int(torch.randint(0, 2**31, (1,)))
            comps = []
            for j in range(params.n):
                gen = torch.Generator().manual_seed(base + j)  # vLLM's child j of a seeded request: seed + j
                if placeholder:
                    k = int(torch.randint(1, int(params.max_tokens) + 1, (1,), generator=gen))
                    tokens, steps = [self.placeholder] * k, None
                elif LLM.sampler == "model":
                    tokens, steps = self._sample(ids, vision, params, gen)
                else:
                    tokens = self._random_tokens(params, gen)
                    steps = self._forced_logits(ids, vision, tokens)
                comps.append(self._completion(j, tokens, steps, params))
            outs.append(RequestOutput(str(r), text, ids, None, comps))
        return outs

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        return self.eos + [int(t) for t in (params.stop_token_ids or [])]

    @torch.no_grad()
    def _sample(self, ids: list[int], vision: dict[str, torch.Tensor], params: SamplingParams,
                gen: torch.Generator) -> tuple[list[int], torch.Tensor]:
        """Ancestral sampling from the held weights; returns the tokens and each step's raw logits [k, V]."""
        stop = self._stop_ids(params)
        sampled = params.temperature > 0
        steps = self.model.generate_steps(
            torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), generator=gen,
            max_new_tokens=int(params.max_tokens), do_sample=sampled,
            temperature=params.temperature if sampled else 1.0,
            top_p=params.top_p, top_k=max(int(params.top_k or 0), 0), eos_token_id=stop,
            pad_token_id=self.processor.pad_token_id, **vision,
        )
        tokens, logits = [], []
        for nxt, z in steps:
            tokens.append(int(nxt[0]))
            logits.append(z[0].float())
            if tokens[-1] in stop:
                break
        return tokens, torch.stack(logits) if logits else torch.zeros(0, 1)

    def _random_tokens(self, params: SamplingParams, gen: torch.Generator) -> list[int]:
        """Ordinary text ids of a random length, ending in EOS when shorter than ``max_tokens``."""
        k = int(torch.randint(1, int(params.max_tokens) + 1, (1,), generator=gen))
        hi = min(470, min(self.processor.token_ids.values()))
        tokens = torch.randint(3, hi, (k,), generator=gen).tolist()
        if k < int(params.max_tokens):
            tokens[-1] = self.eos[0]
        return tokens

    @torch.no_grad()
    def _forced_logits(self, ids: list[int], vision: dict[str, torch.Tensor], tokens: list[int]) -> torch.Tensor:
        """The held weights' raw logits [k, V] predicting each of ``tokens`` after the prompt (one forward)."""
        full = torch.tensor([ids + tokens])
        out = self.model(input_ids=full, attention_mask=torch.ones_like(full), logits_to_keep=len(tokens) + 1, **vision)
        return out.logits[0, :-1].float()

    def _completion(self, j: int, tokens: list[int], logits: torch.Tensor | None,
                    params: SamplingParams) -> CompletionOutput:
        """A CompletionOutput with vLLM's per-step ``{token_id: Logprob}`` under ``logprobs_mode``."""
        from keye.model.generation import top_k_top_p_filter

        stop = self._stop_ids(params)
        finish = "stop" if tokens and tokens[-1] in stop else "length"
        text = self.processor.decode(tokens, skip_special_tokens=True)
        if logits is None or params.logprobs is None:
            return CompletionOutput(j, text, tokens, None, None, finish)
        z = logits
        if self.logprobs_mode.startswith("processed") and params.temperature > 0:
            z = top_k_top_p_filter(z / params.temperature, max(int(params.top_k or 0), 0), params.top_p)
        scores = z if self.logprobs_mode.endswith("logits") else torch.log_softmax(z, dim=-1)
        steps = []
        for i, t in enumerate(tokens):
            rank = int((scores[i] > scores[i, t]).sum()) + 1
            steps.append({t: Logprob(float(scores[i, t]), rank, self.processor.decode([t]))})
        total = float(sum(d[t].logprob for d, t in zip(steps, tokens)))
        return CompletionOutput(j, text, tokens, total, steps, finish)


def reset() -> types.ModuleType:
    """Forget the recorded engines, placeholder calls and sampler choice; returns this module (to register as
    ``vllm``)."""
    LLM.instances = []
    LLM.placeholder_calls = set()
    LLM.sampler = "random"
    return sys.modules[__name__]


def install() -> types.ModuleType:
    """Register this module as ``vllm`` for the rest of the process (scripts; tests use monkeypatch)."""
    sys.modules["vllm"] = reset()
    return sys.modules["vllm"]
