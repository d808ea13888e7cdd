"""Small CuTe-DSL plumbing shared by the kernels."""

from __future__ import annotations

import copy

import cutlass


class DslStruct:
    """A plain object that the DSL can carry through dynamic control flow.

    Attributes named in `_dynamic_` are DSL values (Int32, Float32, rmem tensors) and are
    threaded through scf.if / scf.for regions; every other attribute is a compile-time
    constant. Without this, an object used inside a dynamic `if` or loop is rejected as a
    Python value that cannot be staged.
    """

    _dynamic_: tuple[str, ...] = ()

    def __extract_mlir_values__(self):
        values, counts = [], []
        for name in self._dynamic_:
            v = cutlass.extract_mlir_values(getattr(self, name))
            values += v
            counts.append(len(v))
        self._value_counts = counts
        return values

    def __new_from_mlir_values__(self, values):
        new = copy.copy(self)
        pos = 0
        for name, n in zip(self._dynamic_, self._value_counts):
            setattr(
                new, name, cutlass.new_from_mlir_values(getattr(self, name), values[pos : pos + n])
            )
            pos += n
        return new
