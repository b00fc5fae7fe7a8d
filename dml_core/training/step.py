"""What distributed data parallel and mixed precision change in :func:`dml_core.training.loop.train_fold`'s training
step, each in one class: :class:`Ranks` (every collective of a fold; the identity in one process) and :class:`Precision`
(autocast and fp16 loss scaling).  The gradient arithmetic under DDP is explained in :mod:`dml_core.training.loop`'s
docstring.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dml_core.distributed import (
    all_gather_no_grad,
    all_gather_with_grad,
    all_ranks_true,
    all_reduce_mean_,
    broadcast_module_,
    broadcast_object,
    get_rank,
    get_world_size,
    is_distributed,
)
from dml_core.training.numerics import Numerics

__all__ = ["AMP_DTYPES", "Ranks", "Precision", "lr_scheduler"]

#: The autocast dtype each ``TrainConfig.amp_dtype`` value (``dml_core.training.config.AMP_DTYPE_NAMES``) names.
AMP_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def lr_scheduler(
    optimizer: torch.optim.Optimizer, warmup_iters: int, schedule: str, total_iters: int
) -> torch.optim.lr_scheduler.LambdaLR | None:
    """The learning-rate schedule, stepped once per iteration, as a factor of every parameter group's own lr:
    ``i / warmup_iters`` at iteration ``i ≤ warmup_iters``, then 1 (constant) or a cosine from 1 down to 0 at
    iteration ``total_iters``.  ``None`` for MLRC's constant rates: no scheduler at all, so the optimiser (and its
    state dict) is exactly what it is without one."""
    if warmup_iters == 0 and schedule == "constant":
        return None

    def factor(step: int) -> float:  # step = iterations done; the next one trains at this factor
        if step < warmup_iters:
            return (step + 1) / warmup_iters
        if schedule == "constant":
            return 1.0
        done = min(1.0, (step - warmup_iters) / (total_iters - warmup_iters))
        return 0.5 * (1.0 + math.cos(math.pi * done))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class Ranks:
    """Everything ``torch.distributed`` changes in a fold, in one place (module docstring).  In one process each
    method is the identity or a no-op, so the single-process path pays one attribute test per call."""

    def __init__(self) -> None:
        self.world, self.rank = get_world_size(), get_rank()
        self.distributed = is_distributed()

    def agree_on_resume(self, resumed_at: int) -> None:
        """Every rank resumes at rank 0's iteration (-1: none resumes)."""
        if broadcast_object(resumed_at) != resumed_at:  # a no-op in one process
            raise ValueError(f"rank {self.rank}: resume_state is not the same iteration as rank 0's ({resumed_at})")

    def share(self, model: nn.Module, loss: nn.Module, device: torch.device) -> nn.Module:
        """Rank 0's loss parameters on every rank (proxies may be initialised differently per rank) and the module
        the training forward calls: under DDP the wrapped model, which broadcasts rank 0's weights at construction
        and averages gradients in backward."""
        broadcast_module_(loss)
        if not self.distributed:
            return model
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    def loss_value(self, loss: nn.Module, emb: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss of the global batch: under DDP embeddings all-gathered with gradient and labels gathered, so
        every rank computes the same loss; the loss never knows about DDP."""
        if self.distributed:
            return loss(all_gather_with_grad(emb.float()), all_gather_no_grad(labels))
        return loss(emb.float(), labels)

    def all_true(self, flag: torch.Tensor) -> bool:
        """``bool(flag)``: the one per-iteration host sync.  Under DDP the AND over ranks: every rank computes the
        same global loss, the AND guards against a rank-local difference ending training on some ranks alone."""
        return all_ranks_true(flag) if self.distributed else bool(flag)

    def average_grads_(self, params: list[nn.Parameter]) -> None:
        """Loss parameters' gradients averaged over ranks (keeps the ranks bit-identical)."""
        if self.distributed:
            all_reduce_mean_([p.grad for p in params if p.grad is not None])

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (one collective under DDP)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out


class Precision:
    """Mixed precision in one place: the training forward under autocast (``amp`` on CUDA with ``amp_dtype``,
    ``cpu_amp`` on CPU with bfloat16, as :func:`dml_core.training.numerics.resolve` decided; the loss runs in fp32) and,
    for fp16 only, loss scaling with one scaler step over all parameter groups (an overflow skips the whole step)."""

    def __init__(self, numerics: Numerics, amp_dtype: str, device: torch.device) -> None:
        self.enabled = numerics.autocast and device.type in ("cuda", "cpu")
        self.dtype = AMP_DTYPES[amp_dtype] if device.type == "cuda" else torch.bfloat16
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler("cuda") if self.enabled and self.dtype == torch.float16 else None

    def forward(self, net: nn.Module, images: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return net(images)
        with torch.autocast(self.device_type, dtype=self.dtype):
            return net(images)

    def backward(self, value: torch.Tensor) -> None:
        (value if self.scaler is None else self.scaler.scale(value)).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)
            self.scaler.update()

    def state_dict(self) -> dict[str, Any] | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
