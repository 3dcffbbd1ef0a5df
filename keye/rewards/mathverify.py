"""Math-expression equivalence through ``math-verify`` with a hard, thread-safe time limit.

math-verify's own timeout uses ``signal.alarm``: it only works on the main thread (elsewhere ``parse`` /
``verify`` raise ``ValueError``) and cannot interrupt long C-level work (huge integer powers in SymPy).
So the default ``"process"`` backend runs ``parse`` + ``verify`` (their own timeouts disabled) in a small
persistent worker process, talks to it over pipes, and kills and lazily restarts it when one comparison
exceeds ``timeout_s``; this works from any thread and any process (a forked child gets its own worker).
The ``"inline"`` backend calls math-verify in this process with its signal timeout (rounded up to whole
seconds); off the main thread it falls back to the process backend.

Verdicts are cached in an LRU keyed by ``(gold, prediction)`` strings, because the rollouts of one RL group
often end in the same answer. ``benchmarks/rewards.py`` measures the cost of each path.
"""

from __future__ import annotations

import math
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict

_HEADER = struct.Struct("<I")
_MAX_FRAME = 1 << 24
_WORKER_CODE = "from keye.rewards.mathverify import _worker_main; _worker_main()"


def _wrap(expr: str) -> str:
    # math-verify's LaTeX extractor needs a math environment; bare answers ("\frac{1}{2}", "x=3") get one.
    if "$" in expr or "\\boxed" in expr or "\\(" in expr or "\\[" in expr:
        return expr
    return f"${expr}$"


def verify_inline(gold: str, pred: str, timeout_s: int | None) -> bool:
    """Run math-verify in this process: parse both sides (bare answers wrapped in ``$...$``) and verify.

    ``timeout_s`` is math-verify's own per-step signal timeout (None disables it; only valid on the main
    thread otherwise). Any math-verify failure counts as "not equivalent".
    """
    from math_verify import parse, verify

    gold_parsed = parse(_wrap(gold), parsing_timeout=timeout_s)
    if not gold_parsed:
        return False
    pred_parsed = parse(_wrap(pred), parsing_timeout=timeout_s)
    if not pred_parsed and _wrap(pred) != pred:
        pred_parsed = parse(pred, parsing_timeout=timeout_s)
    if not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s))


def _worker_main() -> None:  # pragma: no cover - runs in the child process
    """Worker loop: read ``(gold, pred)`` frames on stdin, answer ``(status, verdict)`` frames on stdout."""
    import logging

    logging.disable(logging.WARNING)  # math-verify warns once that its own timeout is disabled
    try:
        import resource

        limit = int(os.environ.get("KEYE_MATHVERIFY_MEM_MB", "4096")) << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, ValueError, OSError):
        pass
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    sys.stdout = sys.stderr  # keep stray prints off the protocol pipe
    inp = sys.stdin.buffer
    # Import and warm SymPy/math-verify before announcing readiness, so start-up never eats into the
    # time limit of the first comparison.
    ready = verify_inline("\\frac{1}{2}", "0.5", None)
    payload = pickle.dumps(("ready", ready))
    out.write(_HEADER.pack(len(payload)) + payload)
    while True:
        head = inp.read(_HEADER.size)
        if len(head) < _HEADER.size:
            return
        (size,) = _HEADER.unpack(head)
        gold, pred = pickle.loads(inp.read(size))
        try:
            reply = ("ok", verify_inline(gold, pred, None))
        except BaseException as err:  # noqa: BLE001 - report, never die on one bad expression
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            reply = ("error", False)
        payload = pickle.dumps(reply)
        out.write(_HEADER.pack(len(payload)) + payload)


class _Worker:
    """One worker process and its pipes; not thread-safe (the verifier serialises access)."""

    def __init__(self, startup_timeout_s: float = 120.0) -> None:
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CODE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            close_fds=True,
        )
        self.pid = os.getpid()
        assert self.proc.stdout is not None
        try:
            status, _ = self._recv(self.proc.stdout.fileno(), time.monotonic() + startup_timeout_s)
        except (TimeoutError, EOFError, OSError, pickle.UnpicklingError, struct.error):
            status = "crash"
        self.ready = status == "ready"
        if not self.ready:
            self.close()

    def call(self, gold: str, pred: str, timeout_s: float) -> tuple[str, bool]:
        """Send one comparison; ``("ok"|"error"|"timeout"|"crash", verdict)``. Kills itself on timeout."""
        payload = pickle.dumps((gold, pred))
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(_HEADER.pack(len(payload)) + payload)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.close()
            return "crash", False
        try:
            status, verdict = self._recv(self.proc.stdout.fileno(), time.monotonic() + timeout_s)
            return status, bool(verdict)
        except TimeoutError:
            self.close()
            return "timeout", False
        except (EOFError, OSError, pickle.UnpicklingError, struct.error):
            self.close()
            return "crash", False

    @classmethod
    def _recv(cls, fd: int, deadline: float) -> tuple[str, bool]:
        (size,) = _HEADER.unpack(cls._read(fd, _HEADER.size, deadline))
        if size > _MAX_FRAME:
            raise EOFError("oversized reply")
        status, verdict = pickle.loads(cls._read(fd, size, deadline))
        return str(status), bool(verdict)

    @staticmethod
    def _read(fd: int, n: int, deadline: float) -> bytes:
        chunks, got = [], 0
        while got < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            # poll, not select: select() fails for descriptors >= 1024, common in large trainer processes.
            poller = select.poll()
            poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
            if not poller.poll(max(1, math.ceil(remaining * 1000))):
                raise TimeoutError
            chunk = os.read(fd, n - got)
            if not chunk:
                raise EOFError("worker closed its pipe")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def alive(self) -> bool:
        return self.ready and self.pid == os.getpid() and self.proc.poll() is None

    def close(self) -> None:
        if self.pid != os.getpid():
            return  # inherited through fork: the parent owns that process
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass


class MathVerifier:
    """Thread-safe math-equivalence checker with a hard time limit and an LRU verdict cache.

    Args:
        timeout_s: wall-clock limit of one comparison (parse of both sides + verify), seconds, > 0.
        backend: "process" (default) or "inline" (see the module docstring).
        cache_size: LRU entries (0 disables caching).

    Raises ``KeyeConfigError`` when math-verify is not installed. ``equivalent(gold, pred)`` never raises: a
    timeout, a math-verify error or a crashed worker count as "not equivalent" and are tallied in ``stats``
    (keys ``calls``, ``cache_hits``, ``timeouts``, ``errors``, ``restarts``).
    """

    def __init__(self, timeout_s: float = 5.0, backend: str = "process", cache_size: int = 8192) -> None:
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            from keye.errors import KeyeConfigError

            raise KeyeConfigError(f"math timeout must be a positive number of seconds, got {timeout_s!r}")
        import importlib.util

        if importlib.util.find_spec("math_verify") is None:
            from keye.errors import KeyeConfigError

            # Without it every math answer would silently score as wrong.
            raise KeyeConfigError("math answers need the math-verify package: pip install 'keye[eval]'")
        self.timeout_s = float(timeout_s)
        self.backend = backend
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], bool] = OrderedDict()
        self._lock = threading.Lock()
        self._worker: _Worker | None = None
        self.stats = {"calls": 0, "cache_hits": 0, "timeouts": 0, "errors": 0, "restarts": 0}
        self.last_status = "ok"
        self._retry_after = 0.0

    def equivalent(self, gold: str, pred: str) -> bool:
        """True if math-verify judges ``pred`` equivalent to ``gold`` within the time limit.

        ``last_status`` is then "ok", "cached", "timeout" or "error" (for diagnostics).
        """
        key = (gold, pred)
        with self._lock:
            self.stats["calls"] += 1
            if key in self._cache:
                self._cache.move_to_end(key)
                self.stats["cache_hits"] += 1
                self.last_status = "cached"
                return self._cache[key]
            status, verdict = self._compute(gold, pred)
            self.last_status = status if status in ("ok", "timeout") else "error"
            if status == "timeout":
                self.stats["timeouts"] += 1
            elif status != "ok":
                self.stats["errors"] += 1
            if self.cache_size > 0 and status in ("ok", "timeout"):
                # A timeout is cached too: the same pair would time out again and cost another restart.
                self._cache[key] = verdict
                if len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            return verdict

    def _compute(self, gold: str, pred: str) -> tuple[str, bool]:
        try:
            return self._compute_unsafe(gold, pred)
        except Exception:  # noqa: BLE001 - an unexpected IPC failure must not escape a reward call
            if self._worker is not None:
                self._worker.close()
                self._worker = None
            return "crash", False

    def _compute_unsafe(self, gold: str, pred: str) -> tuple[str, bool]:
        if self.backend == "inline" and threading.current_thread() is threading.main_thread():
            try:
                return "ok", verify_inline(gold, pred, max(1, math.ceil(self.timeout_s)))
            except Exception:  # noqa: BLE001 - any math-verify failure is "not equivalent"
                return "error", False
        worker = self._worker
        if worker is None and time.monotonic() < self._retry_after:
            return "crash", False  # the worker could not start recently; do not pay a start per call
        if worker is None or not worker.alive():
            if worker is not None:
                worker.close()
                self.stats["restarts"] += 1
            worker = self._worker = _Worker()
            if not worker.ready:
                self._worker = None
                self._retry_after = time.monotonic() + 30.0
                return "crash", False
        return worker.call(gold, pred, self.timeout_s)

    def close(self) -> None:
        """Stop the worker process (a later call starts a new one)."""
        with self._lock:
            if self._worker is not None:
                self._worker.close()
                self._worker = None

    def clear_cache(self) -> None:
        """Forget every cached verdict."""
        with self._lock:
            self._cache.clear()


_VERIFIERS: dict[tuple[float, str, int], MathVerifier] = {}
_VERIFIERS_LOCK = threading.Lock()


def get_verifier(timeout_s: float = 5.0, backend: str = "process", cache_size: int = 8192) -> MathVerifier:
    """The shared ``MathVerifier`` for these settings (one worker process per distinct setting)."""
    key = (float(timeout_s), backend, int(cache_size))
    with _VERIFIERS_LOCK:
        verifier = _VERIFIERS.get(key)
        if verifier is None:
            verifier = _VERIFIERS[key] = MathVerifier(timeout_s, backend, cache_size)
        return verifier


def _close_all() -> None:
    for verifier in list(_VERIFIERS.values()):
        verifier.close()


import atexit  # noqa: E402 - registered after the definitions it uses

atexit.register(_close_all)
