"""`CountOps`: counts the torch ops issued inside a `with` block. The host-path tests use it
to show that a call issues no tensor op (on a device, each would be a launch, and reading an
index tensor's values a sync)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))
