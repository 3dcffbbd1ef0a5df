"""Runner: batching, resumable predictions (crash mid-file), rank sharding + gathering, KeyeEngine glue."""

from __future__ import annotations

import json

import pytest
import torch

from keye.errors import KeyeInputError
from keye.eval.runner import (
    KEYE_SAMPLING,
    KeyeEngine,
    PredictionStore,
    gather_parts,
    part_path,
    run_inference,
)

from .conftest import CannedEngine


def _items(n: int) -> list[dict]:
    return [{"id": f"q{i}", "question": f"question {i}"} for i in range(n)]


def _conv(item):
    return [{"role": "user", "content": [{"type": "text", "text": item["question"]}]}]


def _record(item, raw, response):
    return {"id": item["id"], "raw_output": raw, "response": response}


def _answer(text: str) -> str:
    return f"<think>about {text}</think>\n\nanswer {text.split()[-1]}"


def test_batches_postprocess_and_order(tmp_path) -> None:
    engine = CannedEngine(_answer)
    out = tmp_path / "pred.jsonl"
    records = run_inference(
        _items(5),
        engine=engine,
        to_conversation=_conv,
        to_record=_record,
        out_path=out,
        batch_size=2,
        progress=False,
        gen_kwargs={"max_new_tokens": 7},
    )
    assert engine.calls == [2, 2, 1]
    assert engine.kwargs[0] == {"max_new_tokens": 7}
    assert [r["id"] for r in records] == [f"q{i}" for i in range(5)]
    assert records[3]["response"] == "answer 3"  # Keye post-processing: text after </think>
    assert records[3]["raw_output"].startswith("<think>")
    assert len(out.read_text().splitlines()) == 5


def test_resume_after_crash_mid_file(tmp_path) -> None:
    out = tmp_path / "pred.jsonl"
    first = CannedEngine(_answer)
    run_inference(
        _items(3), engine=first, to_conversation=_conv, to_record=_record, out_path=out, progress=False
    )
    # Simulate a crash while the 4th record was being written: a truncated, undecodable last line.
    with open(out, "a") as f:
        f.write('{"id": "q3", "raw_output": "ans')
    second = CannedEngine(_answer)
    records = run_inference(
        _items(6),
        engine=second,
        to_conversation=_conv,
        to_record=_record,
        out_path=out,
        batch_size=8,
        progress=False,
    )
    assert second.calls == [3]  # q3, q4, q5 only: q0-q2 were kept, the cut q3 is answered again
    assert [r["id"] for r in records] == [f"q{i}" for i in range(6)]
    lines = out.read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == [f"q{i}" for i in range(6)]
    # A third run has nothing left to do.
    third = CannedEngine(_answer)
    run_inference(
        _items(6), engine=third, to_conversation=_conv, to_record=_record, out_path=out, progress=False
    )
    assert third.calls == []


def test_lost_final_newline_is_restored(tmp_path) -> None:
    out = tmp_path / "pred.jsonl"
    out.write_text('{"id": "q0", "response": "x"}')  # complete record, newline lost
    assert list(PredictionStore(out).load()) == ["q0"]
    PredictionStore(out).append([{"id": "q1"}])
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["q0", "q1"]


def test_corrupt_middle_line_is_an_error(tmp_path) -> None:
    out = tmp_path / "pred.jsonl"
    out.write_text('{"id": "q0"}\nnot json\n{"id": "q2"}\n')
    with pytest.raises(KeyeInputError, match="line 2"):
        PredictionStore(out).load()


def test_two_ranks_shard_and_rank0_gathers(tmp_path) -> None:
    out = tmp_path / "pred.jsonl"
    items = _items(5)
    e1, e0 = CannedEngine(_answer), CannedEngine(_answer)
    mine = run_inference(
        items,
        engine=e1,
        to_conversation=_conv,
        to_record=_record,
        out_path=out,
        rank=1,
        world_size=2,
        progress=False,
    )
    assert [r["id"] for r in mine] == ["q1", "q3"]
    assert part_path(out, 1, 2).exists() and not out.exists()
    records = run_inference(
        items,
        engine=e0,
        to_conversation=_conv,
        to_record=_record,
        out_path=out,
        rank=0,
        world_size=2,
        progress=False,
    )
    assert sum(e0.calls) == 3  # q0, q2, q4
    assert [r["id"] for r in records] == [f"q{i}" for i in range(5)]
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [f"q{i}" for i in range(5)]
    assert not part_path(out, 0, 2).exists() and not part_path(out, 1, 2).exists()


def test_gather_keeps_existing_records(tmp_path) -> None:
    out = tmp_path / "p.jsonl"
    PredictionStore(out).append([{"id": "a", "v": 1}])
    PredictionStore(part_path(out, 1, 2)).append([{"id": "a", "v": 2}, {"id": "c"}])
    PredictionStore(part_path(out, 0, 2)).append([{"id": "b"}])
    merged = gather_parts(out, 2, order=["a", "b", "c"])
    assert merged["a"]["v"] == 1 and list(merged) == ["a", "b", "c"]


def test_input_errors(tmp_path) -> None:
    engine = CannedEngine(_answer)
    kw = dict(
        engine=engine, to_conversation=_conv, to_record=_record, out_path=tmp_path / "p.jsonl", progress=False
    )
    with pytest.raises(KeyeInputError, match="duplicate"):
        run_inference(_items(2) + _items(1), **kw)
    with pytest.raises(KeyeInputError, match="no 'id'"):
        run_inference([{"question": "x"}], **kw)

    class Short:
        def generate(self, conversations, **kwargs):
            return ["x"]

    with pytest.raises(KeyeInputError, match="1 answers for 2"):
        run_inference(_items(2), **{**kw, "engine": Short(), "batch_size": 2})


class FakeProcessor:
    """Left-pads a fake prompt of len(text) tokens; decodes ids as a string of numbers."""

    def __init__(self):
        self.calls = []

    def __call__(self, conversations, return_tensors="pt", mode=None):
        self.calls.append((len(conversations), mode))
        lengths = [len(c[0]["content"][0]["text"]) for c in conversations]
        width = max(lengths)
        ids = torch.zeros(len(conversations), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, n in enumerate(lengths):
            ids[row, width - n :] = 7
            mask[row, width - n :] = 1
        return {"input_ids": ids, "attention_mask": mask}

    def batch_decode(self, ids, skip_special_tokens=True):
        assert skip_special_tokens
        return [" ".join(str(int(t)) for t in row) for row in ids]


class FakeModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.calls = []

    def generate(self, input_ids, attention_mask, **kwargs):
        self.calls.append(kwargs)
        new = torch.arange(kwargs["max_new_tokens"]).repeat(input_ids.shape[0], 1) + 100
        return torch.cat([input_ids, new], dim=1)


def test_keye_engine_glue() -> None:
    model, processor = FakeModel(), FakeProcessor()
    engine = KeyeEngine(model, processor, batch_size=2, max_new_tokens=3, mode="think")
    convs = [_conv({"question": q}) for q in ("ab", "abcd", "a")]
    answers = engine.generate(convs)
    assert answers == ["100 101 102"] * 3  # only the new tokens are decoded
    assert processor.calls == [(2, "think"), (1, "think")]
    assert model.calls[0] == {"max_new_tokens": 3, "do_sample": False}  # greedy: no sampling parameters
    engine_s = KeyeEngine(model, processor, max_new_tokens=2, **KEYE_SAMPLING)
    engine_s.generate(convs[:1], max_new_tokens=4)
    assert model.calls[-1] == {
        "max_new_tokens": 4,
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
    }
    with pytest.raises(KeyeInputError):
        KeyeEngine(model, processor, batch_size=0)


def test_read_only_load_leaves_other_ranks_files_alone(tmp_path) -> None:
    path = tmp_path / "p.rank1.jsonl"
    content = '{"id": "q1"}\n{"id": "q3", "raw'
    path.write_text(content)
    assert list(PredictionStore(path).load(repair=False)) == ["q1"]
    assert path.read_text() == content  # untouched: only its writer repairs it
    assert list(PredictionStore(path).load()) == ["q1"]
    assert path.read_text() == '{"id": "q1"}\n'
