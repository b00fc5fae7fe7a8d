"""Small torch.distributed helpers used by :mod:`dml_core.training.loop`.

Everything here degrades to a no-op in a single process (``dist.is_initialized()`` false), so the
training loop has one code path.  Works with gloo (CPU) and NCCL (GPU); only collectives that
both backends support are used (all_gather, all_reduce, broadcast — no reduce_scatter / all_to_all).

Why a hand-written all-gather with gradient (:class:`AllGatherWithGrad`): DML losses compare every
embedding with every other one, so under data parallelism each rank must see the *global* batch.
``torch.distributed.all_gather`` has no autograd; ``torch.distributed.nn.functional.all_gather``
does, but its backward relies on all_to_all / reduce_scatter, which not every backend build has.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "is_distributed",
    "get_rank",
    "get_world_size",
    "AllGatherWithGrad",
    "all_gather_with_grad",
    "all_gather_no_grad",
    "all_gather_uneven",
    "all_ranks_true",
    "all_reduce_mean_",
    "broadcast_object",
    "broadcast_tensor_",
    "broadcast_buffers_",
    "broadcast_module_",
    "shard_bounds",
]


def is_distributed() -> bool:
    """True inside an initialised process group with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class AllGatherWithGrad(torch.autograd.Function):
    """Concatenate every rank's ``(b, ...)`` tensor along dim 0, in rank order, differentiably.

    Backward: rank ``r``'s input ``x_r`` feeds the gathered tensor on *every* rank, so its gradient is
    the sum over ranks ``k`` of the slice ``r`` of rank ``k``'s upstream gradient (all_reduce SUM,
    then take own slice).  When every rank computes the same global loss ``L`` (our case), this is
    ``W · ∂L/∂x_r``; DistributedDataParallel's gradient *averaging* over W ranks then gives exactly
    ``Σ_r (∂x_r/∂θ)ᵀ ∂L/∂x_r = ∂L/∂θ``, the single-process gradient (see ``dml_core.training.loop``).
    All ranks must pass the same first-dimension size (the sampler guarantees it).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        world, rank = dist.get_world_size(), dist.get_rank()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        ctx.rank, ctx.size = rank, x.shape[0]
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()  # all_reduce is in place; never touch autograd's buffer
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        start = ctx.rank * ctx.size
        return grad[start : start + ctx.size]


def all_gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """Global batch from per-rank slices, keeping the graph; identity in a single process."""
    if not is_distributed():
        return x
    return AllGatherWithGrad.apply(x)


@torch.no_grad()
def all_gather_no_grad(x: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-sized per-rank tensors (e.g. labels) along dim 0, in rank order."""
    if not is_distributed():
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=0)


@torch.no_grad()
def all_gather_uneven(x: torch.Tensor) -> torch.Tensor:
    """Concatenate per-rank tensors whose first dimension may differ (validation shards).

    gloo's all_gather needs equal shapes, so each rank pads to the largest shard, and the padding
    is cut off again using the gathered sizes.  Trailing dimensions and dtype must agree.
    """
    if not is_distributed():
        return x
    world = dist.get_world_size()
    size = torch.tensor([x.shape[0]], dtype=torch.long, device=x.device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    counts = [int(s.item()) for s in sizes]
    top = max(counts)
    padded = x.new_zeros((top, *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([p[:n] for p, n in zip(parts, counts)], dim=0)


@torch.no_grad()
def all_ranks_true(flag: torch.Tensor) -> bool:
    """``bool(flag)`` agreed on by every rank (logical AND), so all ranks take the same branch."""
    if not is_distributed():
        return bool(flag)
    t = flag.to(torch.int32).reshape(1)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


@torch.no_grad()
def all_reduce_mean_(tensors: list[torch.Tensor]) -> None:
    """Average tensors across ranks in place, with one collective (flattened buffer)."""
    if not is_distributed() or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= dist.get_world_size()
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s picklable object on every rank (e.g. the metrics dict for early stopping)."""
    if not is_distributed():
        return obj
    box = [obj if get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


@torch.no_grad()
def broadcast_tensor_(t: torch.Tensor, src: int = 0) -> None:
    """In-place broadcast of one tensor; bool tensors travel as uint8 (not every backend has bool)."""
    if t.dtype == torch.bool:
        tmp = t.to(torch.uint8)
        dist.broadcast(tmp, src=src)
        t.copy_(tmp.bool())
    else:
        dist.broadcast(t, src=src)


@torch.no_grad()
def broadcast_buffers_(module: torch.nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s buffers (BatchNorm running stats) to every rank before evaluation."""
    if not is_distributed():
        return
    for buf in module.buffers():
        broadcast_tensor_(buf, src=src)


@torch.no_grad()
def broadcast_module_(module: torch.nn.Module, src: int = 0) -> None:
    """Rank ``src``'s parameters and buffers on every rank (e.g. randomly initialised proxies)."""
    if not is_distributed():
        return
    for t in list(module.parameters()) + list(module.buffers()):
        broadcast_tensor_(t.data, src=src)


def shard_bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """Contiguous ``[start, stop)`` of rank's shard of ``n`` items; sizes differ by at most one.

    Contiguous shards concatenated in rank order restore the original order, so gathered
    validation embeddings line up with ``dataset.labels`` without gathering labels.
    """
    return (n * rank) // world, (n * (rank + 1)) // world
