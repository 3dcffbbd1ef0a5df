"""benchmarks/sft_memory.py in its quick mode: both sides run in their own processes, take the same step, and the
chunked loss needs less memory."""

from __future__ import annotations

import re
import sys

from tests.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import sft_memory  # noqa: E402


def test_quick_mode_runs_and_reports_equal_values(capsys):
    # the quick row, with a 32K vocabulary so that the test stays near 20 s (two fresh processes import torch and
    # keye); the script's default is Qwen3's 151,936
    sft_memory.main(["--tokens", "1024", "--vocab", "32000"])
    lines = capsys.readouterr().out.strip().splitlines()
    last = re.fullmatch(r"sft step peak memory at 1024 tokens full vs chunked: (\d+\.\d\d)x less \(values equal: (\w+)\)",
                        lines[-1])
    assert last, lines[-1]
    assert last.group(2) == "yes", lines
    # 1,024 tokens of full logits and autograd's copies of them against two 512-row chunks (2.4x measured)
    assert float(last.group(1)) > 1.3, lines


def test_the_row_is_packed_with_prompts_outside_the_loss():
    mb = sft_memory.build_row(2500, vocab=5000)
    assert mb["seq_lens"].tolist() == [1024, 1024, 452] and mb["input_ids"].shape == (1, 2500)
    assert mb["num_label_tokens"] == 2500 - 3 * sft_memory.PROMPT_TOKENS
    assert int(mb["input_ids"].min()) >= 1000
