"""Run a script under ``torchrun`` (gloo ranks on this machine) from a test, and say why it failed if it did.

torchrun's own report of a failed rank is a long launcher traceback and an exit code (``-6 (SIGABRT)``);
what the rank printed before dying is further up in stderr, and a plain ``stderr[-4000:]`` tail shows only
the launcher. :func:`torchrun` turns on :mod:`faulthandler` in the ranks (a rank killed by a signal then
prints the Python stack of every thread) and, on failure, raises with each rank's own lines first and the
launcher's summary last.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import warnings
from collections.abc import Mapping, Sequence

# The launcher's traceback starts at runpy's frame; everything before it is what the ranks printed.
_LAUNCHER_TRACEBACK = re.compile(r'^Traceback \(most recent call last\):\n  File "<frozen runpy>"', re.M)
# Lines that explain a rank dying outside Python's exception handling.
_CRASH_LINE = re.compile(r"terminate called|what\(\):|Fatal Python error|Aborted|Segmentation fault|"
                         r"double free|corrupted|Error|error:|exitcode|Signal \d+", re.I)


def job_args(script: object, jobs: Sequence[Sequence[object]]) -> list[object]:
    """``script JOB1 -- JOB2 -- ...``: the arguments of one launch of a script that runs ``--``-separated jobs in
    turn (``tests/train/_dist_sft.py``, ``_dist_rlep.py``), so one launch's imports serve several runs."""
    args: list[object] = [script]
    for i, job in enumerate(jobs):
        args += (["--"] if i else []) + list(job)
    return args


def failure_report(proc: subprocess.CompletedProcess, limit: int = 16000) -> str:
    """A readable account of a failed torchrun: the crash lines, what the ranks printed, the launcher summary.

    ``limit`` bounds the ranks' part (its end is kept: a rank's last words are at the end of its output)."""
    out, err = proc.stdout or "", proc.stderr or ""
    match = _LAUNCHER_TRACEBACK.search(err)
    ranks, launcher = (err[: match.start()], err[match.start():]) if match else (err, "")
    summary = launcher[launcher.find("=" * 20):] if "=" * 20 in launcher else launcher[-3000:]
    crash = [line for line in ranks.splitlines() if _CRASH_LINE.search(line)][-40:]
    parts = [f"torchrun exited with {proc.returncode}"]
    if crash:
        parts.append("crash lines:\n" + "\n".join(crash))
    parts.append("ranks' stderr (end):\n" + ranks[-limit:])
    if out.strip():
        parts.append("stdout (end):\n" + out[-3000:])
    parts.append("launcher summary:\n" + summary)
    return "\n\n".join(parts)


def crash_signal(proc: subprocess.CompletedProcess) -> int | None:
    """The signal that killed the first failing rank (torchrun's "Root Cause" entry), or None if that rank
    exited with a status (a Python exception) or the launch succeeded."""
    err = proc.stderr or ""
    if proc.returncode == 0 or "Root Cause" not in err:
        return None
    match = re.search(r"exitcode\s*:\s*(-?\d+)", err[err.rindex("Root Cause"):])
    return -int(match.group(1)) if match and int(match.group(1)) < 0 else None


def torchrun(args: Sequence[object], *, nproc: int = 2, env: Mapping[str, str] | None = None, timeout: float = 900,
             cwd: object = None, check: bool = True, reruns_after_signal: int = 0) -> subprocess.CompletedProcess:
    """Run ``python -m torch.distributed.run --standalone --nproc_per_node=nproc *args`` and return the result.

    ``env`` is added to this process's environment (``OMP_NUM_THREADS=1`` and ``PYTHONFAULTHANDLER=1`` by
    default). With ``check`` a non-zero exit status raises ``AssertionError`` with :func:`failure_report`.
    After ``timeout`` seconds the launcher and every rank are killed (a hung rank must not outlive the test)
    and ``subprocess.TimeoutExpired`` is raised.

    ``reruns_after_signal`` (for launches whose outputs a rerun simply overwrites) runs the launch again,
    at most that many times, when a rank was killed by a signal (a native crash, not a Python error): each
    such crash is reported as a :class:`RankCrashWarning` carrying the full report, so it stays visible in
    the test summary; a Python exception in a rank is never rerun."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
           *map(str, args)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
    for attempt in range(reruns_after_signal + 1):
        proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, cwd=None if cwd is None else str(cwd))
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
        sig = crash_signal(done)
        if sig is None or attempt == reruns_after_signal:
            break
        warnings.warn(RankCrashWarning(f"a rank was killed by signal {sig}; running the launch again\n\n"
                                       + failure_report(done)), stacklevel=2)
    if check and done.returncode != 0:
        raise AssertionError(failure_report(done))
    return done


class RankCrashWarning(UserWarning):
    """A torchrun rank died of a signal and the launch was run again (see :func:`torchrun`)."""
