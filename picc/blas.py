"""How many threads numpy's BLAS uses while picc's reference interpreter runs.

The interpreter (profiling, evaluation, sparsity sweeps) multiplies many small matrices (a
window of 256 tokens by one layer's weights); OpenBLAS's threads spin-wait between them, and on a
machine with few cores that something else also uses, they fight: profiling SmolLM2 on 2048
tokens took 51 s with OpenBLAS's default threads and 8 s with one, on the 2-core build machine.
``blas_threads(1)`` pins numpy's OpenBLAS to one thread for a block of work and restores it
after. Where numpy's BLAS is not an OpenBLAS picc can find, it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
from collections.abc import Iterator
from functools import cache

# numpy's wheels ship scipy-openblas with suffixed symbols; other builds use the plain names.
_SYMBOLS = (("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
            ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
            ("openblas_get_num_threads", "openblas_set_num_threads"))


@cache
def _openblas() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | None:
    import numpy

    libs = os.path.join(os.path.dirname(os.path.dirname(numpy.__file__)), "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libs, "*openblas*.so*"))):
        try:
            lib = ctypes.CDLL(path)  # already loaded by numpy: the same handle
        except OSError:
            continue
        for get, put in _SYMBOLS:
            if hasattr(lib, get) and hasattr(lib, put):
                getter, setter = getattr(lib, get), getattr(lib, put)
                getter.restype = ctypes.c_int
                setter.argtypes = [ctypes.c_int]
                return getter, setter
    return None


@contextlib.contextmanager
def blas_threads(n: int) -> Iterator[None]:
    """numpy's OpenBLAS on ``n`` threads inside the block (unchanged where it cannot be found)."""
    funcs = _openblas()
    if funcs is None:
        yield
        return
    get, put = funcs
    before = int(get())
    put(n)
    try:
        yield
    finally:
        put(before)
