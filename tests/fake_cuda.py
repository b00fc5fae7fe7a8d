"""Run code written for CUDA tensors on a machine without a GPU, to check what a CPU run cannot.

Under ``fake_cuda()`` a tensor made with ``device="cuda"`` (or by ``to_fake_cuda``) reports ``cuda:0``
(``is_cuda`` is True, so the code under test takes its CUDA branches) while its data lives in an ordinary CPU
tensor; every aten op reaches one ``TorchDispatchMode``, which runs it on the CPU data and

* raises, as CUDA does, when an op mixes a cuda tensor with a CPU tensor of one or more dimensions (0-dim CPU
  tensors are scalars to CUDA; copies and advanced-indexing with CPU indices are allowed, as on a GPU);
* records every op applied to cuda tensors, with the TF32 setting of ``torch.backends.cuda.matmul`` at that
  moment, so a test can check that each op has a CUDA kernel in this torch build (``cuda_kernel_missing``)
  and that no fp32 product ran with TF32 allowed.

Numerics are the CPU's (MKL, not cuBLAS) and nothing is timed: this is not a GPU run.  It finds the bugs a GPU
run would find first -- a buffer, index or constant made on the CPU and mixed with device tensors, ``.numpy()``
of a device tensor, an op without a CUDA kernel -- in a test that runs in CI.  ``tests/test_cuda.py`` and the
``needs a CUDA device`` tests run the same code on a real GPU where there is one.

A few Python-level tensor methods (indexing, ``item``/``float``/``int``/``bool``, ``nonzero``, ``copy_``, ``~``) open a
CUDA device guard before dispatch, which would call the missing driver: the fake tensor class answers them
itself, through the aten op where there is one (so the mode sees it).  ``torch.tensor(..., device="cuda")``,
``new_tensor`` and ``.cuda()`` initialise the driver before any dispatch and are not faked: inputs are made with
``to_fake_cuda``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

CUDA = torch.device("cuda", 0)
#: What ``torch.cuda.mem_get_info`` answers under ``fake_cuda()``: an 80 GB card with 78 GB free.
FAKE_FREE_BYTES, FAKE_TOTAL_BYTES = 78 << 30, 80 << 30
_aten = torch.ops.aten
# ops that may take CPU tensors next to CUDA ones on a real GPU: cross-device copies, and CPU index tensors
_MIXING_ALLOWED = {
    _aten.copy_.default,
    _aten._to_copy.default,
    _aten.index.Tensor,
    _aten.index_put_.default,
    _aten.index_put.default,
    _aten._index_put_impl_.default,
}
_PRODUCTS = {
    _aten.mm.default,
    _aten.mm.out,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.matmul.default,
    _aten.baddbmm.default,
}


class FakeCudaTensor(torch.Tensor):
    """A tensor that says it is on ``cuda:0``; its data is the CPU tensor ``inner``."""

    inner: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            inner.shape,
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            device=CUDA,
            requires_grad=False,
        )
        out.inner = inner
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} on a fake CUDA tensor outside fake_cuda()")

    def __repr__(self):
        return f"FakeCudaTensor({self.inner!r})"

    # --- Python methods that open a CUDA device guard before dispatch: answered here ---
    def __getitem__(self, index):
        return _wrap(self.inner[tree_map(_unwrap, index)])

    def __setitem__(self, index, value):
        self.inner[tree_map(_unwrap, index)] = _unwrap(value)

    def nonzero(self, *, as_tuple=False):
        out = _aten.nonzero.default(self)
        return out.unbind(1) if as_tuple else out

    def copy_(self, src, non_blocking=False):
        return _aten.copy_.default(self, src, non_blocking)

    def __invert__(self):
        return _aten.bitwise_not.default(self)

    def item(self):
        return _aten._local_scalar_dense.default(self)

    def __float__(self):
        return float(self.item())

    def __int__(self):
        return int(self.item())

    def __index__(self):
        return self.inner.__index__()

    def __bool__(self):
        return bool(self.item())

    def tolist(self):
        return self.inner.tolist()

    def numpy(self, *args, **kwargs):
        raise TypeError(
            "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
            "host memory first."
        )

    __array__ = numpy


def _unwrap(t):
    return t.inner if isinstance(t, FakeCudaTensor) else t


def _wrap(t):
    return FakeCudaTensor(t) if isinstance(t, torch.Tensor) and not isinstance(t, FakeCudaTensor) else t


def _is_cuda_device(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


@dataclass
class FakeCudaLog:
    """What ran on fake CUDA tensors: op overloads, and each fp32 product as (output shape, TF32 flag then)."""

    ops: set = field(default_factory=set)
    products: list = field(default_factory=list)

    def cuda_kernel_missing(self) -> list[str]:
        """Ops that ran on cuda tensors but have no CUDA (or backend-independent) kernel in this torch build."""
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        keys = (
            "CUDA",
            "CompositeExplicitAutograd",
            "CompositeExplicitAutogradNonFunctional",
            "CompositeImplicitAutograd",
        )
        return sorted(op.name() for op in self.ops if not any(has(op.name(), k) for k in keys))


class _Mode(TorchDispatchMode):
    def __init__(self, log: FakeCudaLog):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_cuda = any(isinstance(t, FakeCudaTensor) for t in tensors)
        device = kwargs.get("device")
        if on_cuda and func not in _MIXING_ALLOWED:
            cpu = [tuple(t.shape) for t in tensors if not isinstance(t, FakeCudaTensor) and t.dim() > 0]
            if cpu:
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, but found at least two devices, "
                    f"cuda:0 and cpu! ({func}, CPU tensors of shapes {cpu})"
                )
        args, kwargs = tree_map(_unwrap, args), tree_map(_unwrap, kwargs)
        if _is_cuda_device(device):
            kwargs["device"] = torch.device("cpu")
        out = func(*args, **kwargs)
        if func is _aten._to_copy.default:  # .to(...) / .cpu(): the target device decides
            to_cuda = _is_cuda_device(device) or (device is None and on_cuda)
        else:
            to_cuda = on_cuda or _is_cuda_device(device)
        if not to_cuda:
            return out
        self.log.ops.add(func)
        if func in _PRODUCTS and args[0].dtype == torch.float32:
            shape = tuple((out if isinstance(out, torch.Tensor) else args[0]).shape)
            self.log.products.append((shape, torch.backends.cuda.matmul.allow_tf32))
        return tree_map(_wrap, out)


def to_fake_cuda(t: torch.Tensor) -> FakeCudaTensor:
    """A fake CUDA copy of a CPU tensor (``.cuda()`` itself would call the driver)."""
    return FakeCudaTensor(t.detach().clone())


@contextlib.contextmanager
def fake_cuda():
    """Fake CUDA tensors for the duration; yields the ``FakeCudaLog``.  ``torch.cuda`` is not initialised:
    factory calls with ``device="cuda"`` would otherwise try to load the driver first."""
    log = FakeCudaLog()
    lazy_init, mem_get_info = torch.cuda._lazy_init, torch.cuda.mem_get_info
    torch.cuda._lazy_init = lambda: None
    torch.cuda.mem_get_info = lambda device=None: (FAKE_FREE_BYTES, FAKE_TOTAL_BYTES)
    try:
        with _Mode(log):
            yield log
    finally:
        torch.cuda._lazy_init, torch.cuda.mem_get_info = lazy_init, mem_get_info
