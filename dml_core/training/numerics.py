"""Which numerics a fold trains with on this machine: the CPU's model and bf16 support, and the resolution of
``TrainConfig.cpu_amp`` / ``channels_last`` = ``"auto"``.

* :func:`cpu_model` — the CPU's model name (``/proc/cpuinfo``'s ``model name``, else :mod:`platform`'s).
* :func:`native_bf16` — whether the CPU computes bfloat16 natively (``avx512_bf16`` or ``amx_bf16``).  Without it
  PyTorch emulates bf16 on CPU and an autocast step is many times slower than fp32 (bench/README_cpu_speed.md).
* :func:`resolve` / :func:`resolve_numerics` — the numerics a :class:`~dml_core.training.config.TrainConfig` gives on a
  device, as flags for the training step and as a short name (``"bf16+channels_last"``, ``"fp32+channels_last"``,
  ``"fp32"``, ``"cuda-amp-fp16"``, ...) that a fold's result records.

``"auto"`` on CPU is bf16 autocast + channels-last where bf16 is native, fp32 + channels-last elsewhere
(channels-last is oneDNN's preferred layout for convolutions either way); on CUDA ``cpu_amp`` means nothing and
channels-last follows ``amp`` (tensor cores prefer NHWC for reduced-precision convolutions).

No torch at import: a trial's driver (which loads no torch) may ask for :func:`cpu_model`; torch is asked for the
CPU's features only where ``/proc/cpuinfo`` cannot be read (not Linux).
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from typing import Any

from dml_core.training.config import NUMERICS_AUTO

__all__ = ["AUTO", "Numerics", "cpu_flags", "cpu_model", "native_bf16", "resolve", "resolve_numerics"]

#: The value of ``cpu_amp`` / ``channels_last`` that leaves the choice to the machine.
AUTO = NUMERICS_AUTO
#: CPU features that give native bfloat16 arithmetic (AVX512-BF16 dot products, AMX tiles).
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_CPUINFO = "/proc/cpuinfo"


def _read_cpuinfo() -> str | None:
    """``/proc/cpuinfo``'s text, or None where there is none (not Linux, or not readable)."""
    try:
        with open(_CPUINFO, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _cpuinfo_field(text: str, key: str) -> str | None:
    """The first ``key : value`` line's value (the first processor's; every core of one machine has the same)."""
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == key:
            return value.strip()
    return None


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags: ``/proc/cpuinfo``'s ``flags`` line, else torch's own CPU probe
    (``torch.cpu.get_capabilities``, the names of the features it finds)."""
    text = _read_cpuinfo()
    flags = _cpuinfo_field(text, "flags") if text is not None else None
    if flags is not None:
        return frozenset(flags.split())
    try:
        import torch  # only where /proc/cpuinfo says nothing: a trial's driver imports this module without torch

        caps = torch.cpu.get_capabilities()
    except Exception:  # an old torch without the probe: no flag known, so no native bf16 claimed
        return frozenset()
    return frozenset(k for k, v in caps.items() if v is True)


@functools.cache
def cpu_model() -> str:
    """The CPU's model name, e.g. ``"Intel(R) Xeon(R) Processor"``; ``platform``'s processor or machine where
    ``/proc/cpuinfo`` has none; ``"unknown"`` if nothing says."""
    text = _read_cpuinfo()
    name = _cpuinfo_field(text, "model name") if text is not None else None
    return name or platform.processor() or platform.machine() or "unknown"


def native_bf16() -> bool:
    """Whether this CPU has native bfloat16 arithmetic (``avx512_bf16`` or ``amx_bf16``)."""
    return any(f in cpu_flags() for f in BF16_FLAGS)


@dataclass(frozen=True)
class Numerics:
    """What a fold's training step runs in: autocast on or off (and its dtype's name), the memory layout, and the
    short name a fold's result records."""

    autocast: bool
    dtype: str  # "fp32", "bf16" or "fp16": the training forward's arithmetic
    channels_last: bool
    name: str


def _cuda_dtype(amp_dtype: str) -> str:
    return "fp16" if amp_dtype in ("float16", "fp16") else "bf16"


def resolve(config: Any, device: Any) -> Numerics:
    """The numerics ``config`` (a :class:`~dml_core.training.config.TrainConfig`) gives on ``device`` (a torch device
    or its type as a string): ``"auto"`` decided here, a ``bool`` taken as it is."""
    kind = getattr(device, "type", str(device).split(":")[0])
    cl = config.channels_last
    if kind == "cuda":
        autocast = bool(config.amp)
        dtype = _cuda_dtype(config.amp_dtype) if autocast else "fp32"
        channels_last = autocast if cl == AUTO else bool(cl)
        name = f"cuda-amp-{dtype}" if autocast else "cuda-fp32"
    else:
        autocast = native_bf16() if config.cpu_amp == AUTO else bool(config.cpu_amp)
        dtype = "bf16" if autocast else "fp32"
        channels_last = True if cl == AUTO else bool(cl)
        name = dtype
    return Numerics(autocast, dtype, channels_last, f"{name}+channels_last" if channels_last else name)


def resolve_numerics(config: Any, device: Any) -> str:
    """The short name of :func:`resolve`'s numerics: ``"bf16+channels_last"``, ``"fp32+channels_last"``, ``"fp32"``,
    ``"bf16"``, ``"cuda-fp32"``, ``"cuda-amp-bf16"``, ``"cuda-amp-fp16+channels_last"``, ..."""
    return resolve(config, device).name
