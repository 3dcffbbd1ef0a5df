"""Peak resident memory of a block of code, sampled from /proc (CPU runs have no allocator counter).

``ru_maxrss`` cannot be used for a block: it is the peak of the whole process, so an earlier, larger peak
(imports, data preparation) hides the block's own. Instead a thread samples the current RSS every
``interval`` seconds while the block runs and reports the largest value minus the RSS at entry.
"""

from __future__ import annotations

import resource
import threading
import time


def current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


class PeakRSS:
    """``with PeakRSS() as m: ...`` then ``m.extra_mib`` = peak RSS during the block minus RSS at entry."""

    def __init__(self, interval: float = 0.0005):
        self.interval = interval
        self.extra_mib = 0.0

    def __enter__(self) -> PeakRSS:
        self.base = current_rss_mib()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss_mib())
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss_mib())
        self.extra_mib = self.peak - self.base
