"""The CUB preset's GPU resources follow what bench/gpu_cub_check.py measured on an H200 (bench/README_gpu.md): one
BN-Inception fold at batch 32 keeps a GPU only 30-40 % busy, four folds on one GPU keep it 98 % busy, each fold
needs its 4 DataLoader workers' CPUs, and bf16 autocast does not pay at this batch size."""

from __future__ import annotations

from pathlib import Path

from pipelines.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def test_mlrc_cub200_shares_each_gpu_among_four_single_worker_folds():
    cfg = load_config(ROOT / "configs" / "mlrc-cub200.yaml")
    r = cfg.resources
    assert r.use_gpu
    assert r.workers_per_fold == 1, "a DDP fold over several GPUs leaves each of them mostly idle at batch 32"
    assert round(1 / r.gpus_per_worker) == 4, "four folds per GPU: 98 % busy, 2.2x one fold's images/s (fp32)"
    assert r.cpus_per_worker >= cfg.protocol.train["num_workers"] >= 4, "decode and augment: ~200 images/s per core"
    assert not cfg.protocol.train.get("amp", False), "bf16 autocast slowed one fold's step (45 vs 37 ms)"
