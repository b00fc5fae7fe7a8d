"""tests/fake_cuda.py itself: it must fail the way a GPU would, or the CUDA-branch tests that use it prove
nothing.  Placement (a CPU tensor meeting a device tensor, ``.numpy()`` of a device tensor), ops without a
CUDA kernel, and the TF32 flag at each fp32 product."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fake_cuda import FakeCudaTensor, fake_cuda, to_fake_cuda


def test_device_tensors_report_cuda_and_compute_like_the_cpu():
    x = torch.randn(6, 4)
    with fake_cuda() as log:
        xc = to_fake_cuda(x)
        made = torch.zeros(3, device=xc.device)
        y = xc @ xc.T + 1
        big = y[y > 1]
        assert xc.is_cuda and made.is_cuda and y.is_cuda and big.is_cuda
        assert isinstance(y, FakeCudaTensor)
        back = y.cpu()
        assert not back.is_cuda and not isinstance(back, FakeCudaTensor)
        assert float(y.sum()) == pytest.approx(float((x @ x.T + 1).sum()))
        assert int((y > 1).sum()) == len(big)
        y[0] = 0  # writes reach the data
        assert y.cpu()[0].abs().sum() == 0
    torch.testing.assert_close(back, x @ x.T + 1)
    assert torch.ops.aten.mm.default in log.ops and not log.cuda_kernel_missing()


@pytest.mark.parametrize(
    "mix",
    [
        lambda xc: xc + torch.ones(4),  # a buffer made without device=
        lambda xc: xc.index_select(0, torch.arange(2)),
        lambda xc: torch.mm(xc, torch.eye(4)),
        lambda xc: torch.add(xc, xc, out=torch.empty(6, 4)),
    ],
)
def test_a_cpu_tensor_meeting_a_device_tensor_raises_as_on_a_gpu(mix):
    with fake_cuda():
        xc = to_fake_cuda(torch.randn(6, 4))
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            mix(xc)


def test_what_a_gpu_allows_is_allowed():
    with fake_cuda():
        xc = to_fake_cuda(torch.randn(6, 4))
        xc * torch.tensor(2.0)  # a 0-dim CPU tensor is a scalar
        xc[torch.tensor([0, 2])]  # CPU indices
        xc.copy_(torch.zeros(6, 4))  # host-to-device copy
        with pytest.raises(TypeError, match="cuda:0 device type tensor to numpy"):
            xc.numpy()
        with pytest.raises(TypeError, match="cuda:0 device type tensor to numpy"):
            np.asarray(xc)


def test_ops_without_a_cuda_kernel_and_tf32_products_are_recorded():
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        with fake_cuda() as log:
            xc = to_fake_cuda(torch.rand(50))
            torch.histogram(xc, bins=torch.linspace(0, 1, 5, device=xc.device))  # CPU-only in torch
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.mm(xc[None], xc[:, None])
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.mm(xc[None], xc[:, None])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    assert log.cuda_kernel_missing() == ["aten::histogram.bins_tensor"]
    assert log.products == [((1, 1), True), ((1, 1), False)]
