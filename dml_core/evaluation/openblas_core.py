"""Which kernels the OpenBLAS inside faiss-cpu uses, chosen from the CPU's own flags before faiss loads it.

faiss-cpu's wheels bundle OpenBLAS 0.3.15 (2021).  It does not know recent Xeon models: on CPUs that report
themselves as "Intel(R) Xeon(R) Processor" with AVX-512 it detects ``Core: Prescott`` and runs its SSE3 kernels, so
every faiss search in the metrics (the faiss backend, query/gallery evaluation, PML's comparisons) runs several times
slower than the CPU allows (measurements and the command: ``bench/README_metrics.md``, "faiss's kernels").

OpenBLAS reads ``OPENBLAS_CORETYPE`` once, when the library is loaded.  :func:`for_faiss_import` sets it for that
moment only, from ``/proc/cpuinfo``: SkylakeX kernels where the CPU has AVX-512 F/DQ/BW/VL, Haswell kernels where it
has AVX2 and FMA, nothing otherwise (OpenBLAS's own detection stands).  A value the user set is never touched, and
the variable is removed again after the import, so processes started later (numpy's own, newer OpenBLAS in them)
detect for themselves.  The choice only selects among kernels the CPU executes; results are the same up to float
rounding.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

__all__ = ["core_for_flags", "cpu_flags", "for_faiss_import"]

VARIABLE = "OPENBLAS_CORETYPE"
_SKYLAKEX = frozenset({"avx512f", "avx512dq", "avx512bw", "avx512vl"})
_HASWELL = frozenset({"avx2", "fma"})


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first CPU's feature flags (empty where ``/proc/cpuinfo`` is not there, e.g. macOS)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def core_for_flags(flags: frozenset[str]) -> str | None:
    """The OpenBLAS kernel set for CPUs with these flags, or None to leave OpenBLAS's detection alone."""
    if _SKYLAKEX <= flags:
        return "SkylakeX"
    if _HASWELL <= flags:
        return "Haswell"
    return None


@contextlib.contextmanager
def for_faiss_import(cpuinfo: str = "/proc/cpuinfo") -> Iterator[str | None]:
    """Around ``import faiss``: ``OPENBLAS_CORETYPE`` set from the CPU's flags, unless the user set it (an empty value
    counts as unset, as OpenBLAS reads it) or faiss is already loaded (then too late); yields the core chosen (None:
    nothing set) and restores the environment."""
    if os.environ.get(VARIABLE) or "faiss" in sys.modules or not sys.platform.startswith("linux"):
        yield None
        return
    core = core_for_flags(cpu_flags(cpuinfo))
    if core is None:
        yield None
        return
    before = os.environ.get(VARIABLE)
    os.environ[VARIABLE] = core
    try:
        yield core
    finally:
        if before is None:
            os.environ.pop(VARIABLE, None)
        else:
            os.environ[VARIABLE] = before
