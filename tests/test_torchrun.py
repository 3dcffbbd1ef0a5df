"""The torchrun test helper says why a rank died: a rank killed by a signal shows its Python stack."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.torchrun import RankCrashWarning, crash_signal, torchrun

ABORTING_RANK = """
import os
import torch.distributed as dist

def die_here():
    os.abort()  # what a C++ std::terminate in a rank looks like from outside: SIGABRT, no Python exception

dist.init_process_group("gloo")
print(f"rank {dist.get_rank()} started", flush=True)
if dist.get_rank() == 1:
    die_here()
dist.barrier()
dist.destroy_process_group()
"""


def test_a_rank_killed_by_a_signal_is_reported_with_its_stack(tmp_path):
    script = tmp_path / "abort_rank1.py"
    script.write_text(ABORTING_RANK)
    with pytest.raises(AssertionError) as err:
        torchrun([script], timeout=120)
    report = str(err.value)
    assert report.startswith("torchrun exited with 1")
    crash = report.split("crash lines:\n", 1)[1].split("\n\n", 1)[0]
    assert "Fatal Python error: Aborted" in crash  # faulthandler in the rank, found among the ranks' lines
    assert "in die_here" in report and "abort_rank1.py" in report  # the dying rank's own stack
    assert "rank 1 started" in report  # stdout kept
    assert report.rstrip().endswith("=" * 20) or "SIGABRT" in report.split("launcher summary:", 1)[1]


def test_a_clean_run_returns_the_completed_process(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n"
                      "print(f'rank {dist.get_rank()} of {dist.get_world_size()}', flush=True)\ndist.barrier()\n"
                      "dist.destroy_process_group()\n")
    done = torchrun([script], timeout=120)
    # The two ranks share one stdout pipe, so one rank's line can land inside the other's: match, don't split.
    assert done.returncode == 0 and sorted(re.findall(r"rank \d of \d", done.stdout)) == ["rank 0 of 2", "rank 1 of 2"]


def test_a_signal_death_is_rerun_with_a_warning_and_a_python_error_is_not(tmp_path):
    # Rank 1 aborts on the first launch only (a marker file remembers it): one rerun, then success.
    script = tmp_path / "abort_once.py"
    marker = tmp_path / "aborted"
    script.write_text(ABORTING_RANK.replace('if dist.get_rank() == 1:',
                                            f'if dist.get_rank() == 1 and not os.path.exists({str(marker)!r}):\n'
                                            f'    open({str(marker)!r}, "w").close()'))
    with pytest.warns(RankCrashWarning, match="killed by signal 6") as caught:
        done = torchrun([script], timeout=120, reruns_after_signal=1)
    assert done.returncode == 0 and len(caught) == 1 and "in die_here" in str(caught[0].message)
    # A Python exception fails at once, whatever the rerun budget: each rank logs its start, one launch only.
    log = tmp_path / "starts.log"
    failing = tmp_path / "raises.py"
    failing.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n"
                       f"open({str(log)!r}, 'a').write('start\\n')\n"
                       "raise ValueError('bad input on purpose')\n")
    with pytest.raises(AssertionError, match="bad input on purpose") as err:
        torchrun([failing], timeout=120, reruns_after_signal=3)
    assert log.read_text().count("start") == 2
    assert crash_signal(subprocess.CompletedProcess([], 1, "", str(err.value))) is None
