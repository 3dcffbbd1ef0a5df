"""Measuring tensor memory on CPU, where ``torch.cuda.max_memory_allocated`` does not exist.

:class:`LiveBytes` is a dispatch mode that sees every tensor an operator creates (forward, backward and
autograd's own buffers run through the dispatcher) and keeps a weak reference to its storage, so it knows
the bytes alive after each operator and their peak. Storages created before the mode was entered (the
parameters, the inputs) are not counted, nor are views of them.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages created inside the mode that are still alive.

    Attributes:
        peak: the largest live total seen after any operator, not counting the storages in ``excluded``.
        excluded: storage keys (:meth:`key`) left out of ``current`` and ``peak`` (e.g. parameter gradients,
            added by :meth:`exclude_grads` as they are accumulated).
    """

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0
        self.excluded: set[int] = set()

    def exclude_grads(self, params) -> list:
        """Leave ``.grad`` of ``params`` out of the totals from the moment each is accumulated; returns the hook
        handles (remove them when done)."""
        def hook(p):
            self.excluded.add(self.key(p.grad))
        return [p.register_post_accumulate_grad_hook(hook) for p in params if p.requires_grad]

    @staticmethod
    def key(t: torch.Tensor) -> int:
        """The identity of ``t``'s storage (shared by all its views)."""
        return t.untyped_storage()._cdata

    def current(self) -> int:
        """Bytes alive now (expired storages dropped)."""
        for k in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[k]
        return sum(n for k, (_, n) in self.live.items() if k not in self.excluded)

    def live_keys(self) -> set[int]:
        """Keys of the storages alive now."""
        self.current()
        return set(self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a view or an in-place result shares an input's storage: that memory was not allocated here
        inputs = {self.key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                if st._cdata not in self.live and st._cdata not in inputs:
                    self.live[st._cdata] = (StorageWeakRef(st), st.nbytes())
        self.peak = max(self.peak, self.current())
        return out
