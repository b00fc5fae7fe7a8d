"""The CUDA path of the library, run where a GPU is (skipped, with the reason, where none is).

What a fold does on a GPU worker, piece by piece:

* every registered loss (and the wrapped ones) gives on CUDA the value and the gradients it gives on CPU;
* ``train_fold`` trains on CUDA in fp32 and with autocast (bf16, and fp16 with the grad scaler), keeps its
  best state on the CPU and its modules on the device;
* with TF32 off, the first iterations on CUDA reproduce the CPU's losses to float32 rounding (the same
  batches and augmentations: both are drawn on the CPU);
* a fold killed mid-way and resumed from its checkpoint on CUDA ends bit-identical to the uninterrupted
  one (cuDNN deterministic; the CUDA RNG state travels in the checkpoint);
* DDP with its CUDA branch (``device_ids``): 2 ranks × 16 on the GPU = 1 process × 32 on the GPU (gloo
  carries CUDA tensors; NCCL needs one GPU per rank, which a one-GPU machine cannot give).

Metrics and the kNN kernel on CUDA are tested in ``test_knn.py`` / ``test_metrics.py``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dml_core.losses import build_loss, list_losses
from dml_core.training.checkpoint import CheckpointDir
from dml_core.training.loop import train_fold

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("one_torch_thread"),
]

WRAPPED = ["sec:triplet", "l2_reg:triplet"]
C, PER_CLASS, D = 6, 4, 16


@pytest.fixture
def ieee_fp32():
    """Full fp32 in matmuls and convolutions for the test (no TF32), restored afterwards."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize("name", list_losses() + WRAPPED)
def test_every_loss_on_cuda_matches_cpu(name, ieee_fp32):
    torch.manual_seed(0)
    cpu = build_loss(name, num_classes=C, embedding_dim=D)
    gpu = build_loss(name, num_classes=C, embedding_dim=D)
    gpu.load_state_dict(cpu.state_dict())
    gpu = gpu.cuda()
    g = torch.Generator().manual_seed(1)
    f = torch.randn(C * PER_CLASS, D, generator=g) * 2.0
    labels = torch.arange(C).repeat_interleave(PER_CLASS)
    x_cpu, x_gpu = f.clone().requires_grad_(True), f.cuda().requires_grad_(True)
    v_cpu, v_gpu = cpu(x_cpu, labels), gpu(x_gpu, labels.cuda())
    v_cpu.backward()
    v_gpu.backward()
    assert v_gpu.device.type == "cuda" and all(p.device.type == "cuda" for p in gpu.parameters())
    assert math.isfinite(v_gpu.item())
    assert v_gpu.item() == pytest.approx(v_cpu.item(), rel=1e-4, abs=1e-5)
    torch.testing.assert_close(x_gpu.grad.cpu(), x_cpu.grad, rtol=1e-3, atol=1e-5)
    for (n, p_cpu), p_gpu in zip(cpu.named_parameters(), gpu.parameters()):
        if p_cpu.grad is not None:
            torch.testing.assert_close(p_gpu.grad.cpu(), p_cpu.grad, rtol=1e-3, atol=1e-5, msg=n)


def _data():
    from test_train_resume import _data as data  # tests/ is on sys.path (rootdir conftest, no package)

    return data()


@pytest.mark.parametrize("amp,amp_dtype", [(False, "bfloat16"), (True, "bfloat16"), (True, "float16")])
def test_train_fold_on_cuda(amp, amp_dtype):
    from test_train_resume import _config, _fresh

    train, val = _data()
    model, loss = _fresh("proxynca_pp", init_seed=7)
    proxies = {k: v.clone() for k, v in loss.state_dict().items()}
    res = train_fold(model, loss, train, val, _config(device="cuda", amp=amp, amp_dtype=amp_dtype, max_epochs=3))
    assert res.status == "ok", res.reason
    assert res.iterations == 9 and len(res.history) == 4  # the untrained model's evaluation, then 3 epochs
    assert all(math.isfinite(r["metrics"]["map_at_r"]) for r in res.history)
    assert all(r["train_loss"] is None or math.isfinite(r["train_loss"]) for r in res.history)
    assert next(model.parameters()).device.type == "cuda" and next(loss.parameters()).device.type == "cuda"
    for part in ("model", "loss"):  # the best state is a CPU copy: it outlives the fold's device
        assert all(t.device.type == "cpu" for t in res.best_state[part].values())
    assert any(not torch.equal(v.cpu(), proxies[k]) for k, v in loss.state_dict().items())  # proxies trained


def test_first_iterations_on_cuda_match_cpu(ieee_fp32):
    from test_train import PairLoss, config, make_data, make_model

    train, val = make_data()
    values = {}
    for device in ("cpu", "cuda"):
        loss = PairLoss()
        res = train_fold(make_model(seed=3), loss, train, val, config(device=device, iters_per_epoch=3, max_epochs=1))
        assert res.status == "ok", res.reason
        values[device] = loss.values
    assert len(values["cpu"]) == len(values["cuda"]) == 3
    assert values["cuda"][0] == pytest.approx(values["cpu"][0], rel=1e-5)  # same weights, same batch
    np.testing.assert_allclose(values["cuda"], values["cpu"], rtol=1e-3)  # after RMSprop steps


@pytest.mark.parametrize("loss_name", ["contrastive", "proxynca_pp"])
def test_resume_on_cuda_is_bit_identical(tmp_path, loss_name):
    from test_train_resume import Killed, _assert_identical, _config, _run

    old = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        config = _config(device="cuda")
        ref = _run(loss_name, config)
        with pytest.raises(Killed):
            _run(loss_name, config, tmp_path / "ckpt", kill_after=4)
        state = CheckpointDir(str(tmp_path / "ckpt")).load()
        assert "cuda" in state["rng"][0]  # the CUDA generator's state is part of the checkpoint
        res, model, loss, saved = _run(loss_name, config, tmp_path / "ckpt", resume=True)
        assert saved[0] == 4 * config.iters_per_epoch
        _assert_identical(ref[:3], (res, model, loss))
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = old


def _deterministic_scenarios():
    """test_train's DDP scenarios on the GPU with deterministic cuDNN kernels (in each process)."""
    from test_train import _run_scenarios

    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    return _run_scenarios("sgd", device="cuda:0")


def _ddp_worker_cuda(rank: int, world: int):
    return _deterministic_scenarios()


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_on_cuda_two_ranks_of_16_equal_one_process_of_32(ieee_fp32):
    from ddp_util import run_ddp
    from test_train import make_model

    old = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    try:
        ref = _deterministic_scenarios()
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = old
    ranks = run_ddp(_ddp_worker_cuda, 2)
    init = make_model(seed=3).state_dict()
    for name, single in ref.items():
        for r, got in enumerate(ranks):
            got = got[name]
            assert (got["status"], got["reason"]) == (single["status"], single["reason"]), f"{name} rank {r}"
            if name == "nan":
                continue
            np.testing.assert_allclose(got["values"], single["values"], rtol=1e-5, atol=1e-6, err_msg=f"{name} {r}")
            for k, v in single["model"].items():
                if v.is_floating_point():
                    torch.testing.assert_close(
                        got["model"][k].cpu() - init[k],
                        v.cpu() - init[k],
                        rtol=1e-5,
                        atol=1e-5,
                        msg=lambda m, k=k: f"{name} {k}: {m}",
                    )
            torch.testing.assert_close(got["emb"], single["emb"], rtol=1e-5, atol=1e-6)  # embedded on the GPU
        for k, v in ranks[0][name]["model"].items():
            assert torch.equal(v, ranks[1][name]["model"][k]), k
    moved = max(
        float((ref["pair"]["model"][k].cpu() - init[k]).abs().max()) for k in init if init[k].is_floating_point()
    )
    assert moved > 1e-4


def test_embed_runs_on_the_models_device_and_names_a_mismatch(ieee_fp32):
    """A model trained on the GPU is embedded there by default (the demo's and the library's calls pass no
    device); a device other than the model's is one clear error, not a CPU/CUDA type clash inside conv2d."""
    from test_train import make_data, make_model

    from dml_core.training.loop import embed, embed_images

    _, val = make_data()
    model = make_model().cuda()
    emb, labels = embed(model, val, batch_size=5)
    assert emb.device.type == "cpu" and len(emb) == len(labels) == len(val)
    ref, _ = embed(model.cpu(), val, batch_size=5)
    torch.testing.assert_close(emb, ref, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="embed: device is 'cpu' but the model is on 'cuda:0'"):
        embed(model.cuda(), val, device="cpu")
    with pytest.raises(ValueError, match="embed_images: device is 'cuda:0' but the model is on 'cpu'"):
        embed_images(model.cpu(), torch.zeros(2, 3, 16, 16), device="cuda")
