"""The reality check's own setting on one GPU, measured: BN-Inception folds at 227 px on a CUB-200-2011-sized dataset.

    python bench/gpu_cub_check.py --out gpu-cub                 # every step (about 6 minutes on an H200)
    python bench/gpu_cub_check.py --out gpu-cub --steps data decode gpu
    python bench/gpu_cub_check.py --out gpu-cub2 --steps data share --share-precision fp32 --share-folds 4 8 \
        --share-workers 4 2                                     # fp32 folds sharing the GPU, 4 and 8 of them
    python bench/gpu_cub_check.py --project gpu-cub/summary.json gpu-cub2/summary.json   # the preset's cost
    python bench/gpu_cub_check.py --out rehearsal --cpu --quick # the same steps, small, on a machine without a GPU

What it does, in order (``--steps`` picks some; later steps need ``data``'s shards in ``--work``):

* ``data``: a synthetic dataset the size and shape of CUB-200-2011 — 200 classes, 11,788 JPEGs at CUB's typical
  sizes (mostly 500 × 375 / 500 × 333 and their portrait forms), each class its own colour field and pattern — in
  CUB's official layout (``images.txt``, ``image_class_labels.txt``, ``train_test_split.txt``, ``images/``), then
  ``dmlrc data prepare cub200`` into parquet shards on local disk, and random BN-Inception weights saved in the
  pretrained file's layout (pretrainedmodels' keys, classifier included) for ``model.pretrained``.
* ``decode``: one CPU core reading, decoding and augmenting images from those shards as a DataLoader worker does
  (the bytes from the shard cache, ``decode_image``, the protocol's train and eval transforms): images/s per core.
* ``gpu``: the training step alone (forward, contrastive loss, backward, three RMSprop steps) on batches already on
  the GPU, fp32 and bf16 autocast: the rate the GPU sustains when it never waits for data, and its memory.
* ``workers``: one fold of ``configs/mlrc-cub200.yaml``'s recipe (BN-Inception, 227 px, 8 classes × 4, RMSprop 1e-6,
  frozen BN, epochs of 100 iterations) through ``dml_core.training.loop.train_fold`` from the shards, for a fixed number
  of epochs, with 2 to 12 DataLoader workers: training images/s after the first epoch, GPU utilisation (nvidia-smi,
  sampled every 200 ms) and memory.
* ``share``: 2 and 4 such folds at once on the one GPU (as Ray's fractional ``gpus_per_worker`` places them; one fold
  alone is the ``workers`` run with 4), each with the preset's 4 DataLoader workers (``--share-folds``,
  ``--share-workers``, ``--share-precision`` choose others): images/s per fold and in total, utilisation and memory.
* ``amp``: one fold in fp32 beside the bf16 folds above (same workers).
* ``eval``: the validation (fold 0's 25 classes) and test (100 classes) embeddings and their metrics, timed apart,
  in fp32 as the folds evaluate, with the preset's 4 workers; plus how far bf16 autocast moves the same embeddings.
* ``accuracy``: the CPU benchmark's accuracy check (``bench/cpu_speed_bench.py``: fold 0 of Omniglot, tiny CNN,
  32 px, 4 epochs × 100 iterations, seeds 0–3, final val MAP@R) on CUDA, fp32 against bf16 autocast.  Omniglot is
  read from ``--omniglot`` (default ``../shared/data/omniglot``).

Results go to ``<out>/summary.json`` (every number), ``<out>/summary.md`` (tables and the projected cost of the whole
preset, :func:`project`) and the console; each step's children log to ``<out>/logs.txt``.  The folds, the training
step and the evaluation run in child processes (a fresh CUDA context each; nvidia-smi reports each one's memory).
``--deadline`` (seconds) skips the steps that would start after it, so a run inside a time-limited call still returns
what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEPS = ("data", "decode", "gpu", "workers", "share", "eval", "accuracy", "amp")
#: CUB-200-2011: 200 classes, 11,788 images (58.94 per class), images up to 500 px on the long side.
CUB_CLASSES, CUB_IMAGES = 200, 11788
#: (width, height) of the synthetic images and how often each occurs: CUB's photos are mostly 500 px wide
#: landscape shots (500 × 375, 500 × 333) with some portraits and squares.
SIZES = (((500, 375), 0.45), ((500, 333), 0.25), ((375, 500), 0.1), ((500, 400), 0.1), ((500, 500), 0.1))
#: configs/mlrc-cub200.yaml's fold recipe (docs/protocol.md): BN-Inception, 227 px, embedding 128, avg pooling,
#: frozen BN, 8 classes × 4, RMSprop 1e-6 / weight decay 1e-4 / momentum 0.9, 100 iterations an epoch,
#: 4 DataLoader workers per DDP worker, eval batches of 256.
RECIPE = {
    "image_size": 227,
    "model": {"trunk": "bninception", "embedding_dim": 128, "pooling": "avg", "layer_norm": False, "freeze_bn": True},
    "train": {
        "classes_per_batch": 8,
        "m": 4,
        "iters_per_epoch": 100,
        "trunk_lr": 1e-6,
        "embedder_lr": 1e-6,
        "weight_decay": 1e-4,
        "momentum": 0.9,
        "eval_batch_size": 256,
    },
    "num_workers": 4,
    "loss": "contrastive",
}


# ------------------------------------------------------------------------------------------------ shared helpers
def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _device(cpu: bool) -> str:
    return "cpu" if cpu else "cuda"


class GpuSampler:
    """nvidia-smi's utilisation and memory every ``interval_ms``, with wall-clock times, in a background process."""

    def __init__(self, interval_ms: int = 200):
        self.samples: list[tuple[float, float, float]] = []  # (time, utilisation %, memory used MiB)
        self._proc = None
        self._thread = None
        self.interval_ms = interval_ms

    def __enter__(self) -> GpuSampler:
        try:
            self._proc = subprocess.Popen(
                [
                    "nvidia-smi",
                    "--query-gpu=utilization.gpu,memory.used",
                    "--format=csv,noheader,nounits",
                    f"--loop-ms={self.interval_ms}",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        except OSError:  # no nvidia-smi (a CPU rehearsal)
            return self
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                util, mem = (float(v) for v in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.time(), util, mem))

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)

    def window(self, start: float, end: float) -> dict:
        """Mean and max utilisation, max memory over [start, end] (wall-clock seconds)."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if not inside:
            return {"gpu_util_mean": None, "gpu_util_max": None, "gpu_mem_max_mib": None, "samples": 0}
        return {
            "gpu_util_mean": round(statistics.fmean(s[1] for s in inside), 1),
            "gpu_util_max": max(s[1] for s in inside),
            "gpu_mem_max_mib": max(s[2] for s in inside),
            "samples": len(inside),
        }


def _compute_apps() -> dict[int, float]:
    """pid -> GPU memory (MiB) of each process holding a CUDA context, as nvidia-smi reports them."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    apps = {}
    for line in out.splitlines():
        try:
            pid, mem = line.split(",")
            apps[int(pid)] = float(mem)
        except ValueError:
            continue
    return apps


def _children(jobs: list[dict], out: Path, timeout: float) -> list[dict]:
    """Run ``--child`` processes at once (one per job) and return their JSON results (``{"error": ...}`` for a
    child that failed).  Each child's output is appended to ``<out>/logs.txt``."""
    procs = []
    apps_seen: dict[int, float] = {}
    for job in jobs:
        fd, path = tempfile.mkstemp(suffix=".json", dir=out)
        os.close(fd)
        cmd = [sys.executable, __file__, "--child", json.dumps(job), "--child-out", path]
        log = open(out / "logs.txt", "a")
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT), path, log))
    t_end = time.time() + timeout
    while any(p.poll() is None for p, _, _ in procs) and time.time() < t_end:
        time.sleep(1.0)
        for pid, mem in _compute_apps().items():  # the largest each child's context reached
            apps_seen[pid] = max(mem, apps_seen.get(pid, 0.0))
    results = []
    for p, path, log in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
        log.close()
        try:
            res = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            res = {"error": f"child exited {p.returncode} without a result (see logs.txt)"}
        res["nvidia_smi_mem_mib"] = apps_seen.get(p.pid)
        Path(path).unlink(missing_ok=True)
        results.append(res)
    return results


# ------------------------------------------------------------------------------------------------------ data step
def _synth_image(args) -> int:
    """One synthetic photo: a smooth colour field (upsampled low-resolution noise) in its class's colours, its
    class's stripe pattern, a random blob (the "bird") and sensor noise; JPEG quality 90.  Returns its size."""
    import numpy as np
    from PIL import Image

    path, cls, idx, width, height = args
    rng = np.random.default_rng([cls, idx])
    crng = np.random.default_rng([cls, 10**6])
    base = crng.uniform(40, 215, size=3)
    low = rng.normal(0, 35, size=(height // 32 + 2, width // 32 + 2, 3)) + base
    field = np.asarray(
        Image.fromarray(np.clip(low, 0, 255).astype(np.uint8)).resize((width, height), Image.BICUBIC), np.float32
    )
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    freq, angle = crng.uniform(0.02, 0.12), crng.uniform(0, np.pi)
    stripes = 25 * np.sin(freq * (xx * np.cos(angle) + yy * np.sin(angle)) + rng.uniform(0, 6.28))
    cy, cx, r = rng.uniform(0.3, 0.7) * height, rng.uniform(0.3, 0.7) * width, rng.uniform(0.15, 0.35) * height
    blob = np.exp(-(((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * r * r)))[..., None] * (crng.uniform(-80, 80, size=3))
    img = field + stripes[..., None] + blob + rng.normal(0, 6, size=field.shape)
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(path, quality=90)
    return os.path.getsize(path)


def step_data(a, out: Path) -> dict:
    import multiprocessing

    import numpy as np

    n_classes = 40 if a.quick else CUB_CLASSES
    n_images = 472 if a.quick else CUB_IMAGES
    scale = 0.25 if a.quick else 1.0
    src = a.work / "CUB_200_2011"
    dest = a.work / "cub200-shards"
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    per_class = np.full(n_classes, n_images // n_classes)
    per_class[: n_images - per_class.sum()] += 1
    sizes = [s for s, _ in SIZES]
    probs = np.array([p for _, p in SIZES])
    jobs, lines = [], {"images": [], "labels": [], "split": []}
    image_id = 0
    for c in range(n_classes):
        cdir = f"{c + 1:03d}.Synthetic_class_{c + 1:03d}"
        (src / "images" / cdir).mkdir(parents=True, exist_ok=True)
        for i in range(per_class[c]):
            image_id += 1
            w, h = sizes[rng.choice(len(sizes), p=probs)]
            rel = f"{cdir}/img_{image_id:05d}.jpg"
            jobs.append((str(src / "images" / rel), c, i, int(w * scale), int(h * scale)))
            lines["images"].append(f"{image_id} {rel}")
            lines["labels"].append(f"{image_id} {c + 1}")
            lines["split"].append(f"{image_id} {int(i % 2 == 0)}")
    for name, key in (
        ("images.txt", "images"),
        ("image_class_labels.txt", "labels"),
        ("train_test_split.txt", "split"),
    ):
        (src / name).write_text("\n".join(lines[key]) + "\n")
    with multiprocessing.Pool(os.cpu_count()) as pool:
        nbytes = pool.map(_synth_image, jobs, chunksize=32)
    t_gen = time.perf_counter() - t0
    _log(f"data: {len(jobs)} JPEGs in {t_gen:.1f} s, mean {np.mean(nbytes) / 1024:.1f} KiB")

    # the product's command: `dmlrc data prepare` through its own parser and runner (pipelines/data_cli.py), without
    # the rest of the console script, whose parser also loads MLflow (not needed to prepare data)
    t1 = time.perf_counter()
    entry = (
        "import argparse, sys; from pipelines.data_cli import add_data_parser; p = argparse.ArgumentParser('dmlrc'); "
        "add_data_parser(p.add_subparsers()); a = p.parse_args(); sys.exit(a.func(a))"
    )
    cmd = [sys.executable, "-c", entry, "data", "prepare", "cub200", "--src", str(src), "--dest", str(dest)]
    cmd += ["--overwrite", "--no-progress"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    t_prep = time.perf_counter() - t1
    if proc.returncode != 0:
        raise RuntimeError(f"dmlrc data prepare failed ({proc.returncode}): {proc.stderr[-2000:]}")
    shard_bytes = sum(p.stat().st_size for p in dest.rglob("*.parquet"))
    _log(f"data: dmlrc data prepare cub200 in {t_prep:.1f} s, {shard_bytes / 2**20:.0f} MiB of shards")

    # random BN-Inception weights in the pretrained file's layout (pretrainedmodels' keys, its 1000-way classifier)
    import torch

    from dml_core.trunks.bninception import BNINCEPTION_FEATURE_DIM, BNInception

    torch.manual_seed(0)
    state = BNInception().state_dict()
    state["last_linear.weight"] = torch.randn(1000, BNINCEPTION_FEATURE_DIM) * 0.01
    state["last_linear.bias"] = torch.zeros(1000)
    weights = a.work / "bn_inception-random.pth"
    torch.save(state, weights)
    return {
        "images": len(jobs),
        "classes": n_classes,
        "jpeg_kib_mean": round(float(np.mean(nbytes)) / 1024, 1),
        "generate_s": round(t_gen, 1),
        "prepare_s": round(t_prep, 1),
        "prepare_command": "dmlrc data prepare cub200 --src <CUB_200_2011> --dest <local dir>",
        "shard_mib": round(shard_bytes / 2**20, 1),
        "weights": str(weights.name),
    }


# ---------------------------------------------------------------------------------------------- in-child helpers
def _fold_parts(a_work: str, fold_index: int, with_weights: bool = True, size: int = RECIPE["image_size"]):
    """The fold's model, loss and datasets exactly as ``pipelines.execution.folds.fold.run_fold`` builds them."""
    from dml_core.data import ImageDataset, eval_transform, read_parquet_manifest, train_transform
    from dml_core.losses import build_loss
    from dml_core.models import build_model
    from dml_core.splits import FoldManifest

    work = Path(a_work)
    table = read_parquet_manifest(work / "cub200-shards")
    manifest = FoldManifest.from_labels(table.labels, 4, "mlrc")
    fold = manifest.folds[fold_index % 4]
    weights = work / "bn_inception-random.pth"
    model = build_model(**RECIPE["model"], pretrained=str(weights) if with_weights else None)
    prep = model.preprocessing
    train_set = ImageDataset(table.subset(fold.train_classes), train_transform(size, prep))
    val_set = ImageDataset(table.subset(fold.val_classes), eval_transform(size, prep))
    test_set = ImageDataset(table.subset(manifest.test_classes), eval_transform(size, prep))
    loss = build_loss(RECIPE["loss"], num_classes=len(fold.train_classes), embedding_dim=128)
    return model, loss, train_set, val_set, test_set


def child_fold(job: dict) -> dict:
    """One fold of the recipe for ``job["epochs"]`` epochs (fixed budget): per-epoch wall-clock marks."""
    import torch

    from dml_core.training.loop import TrainConfig, train_fold

    torch.set_num_threads(int(job.get("threads", 2)))
    model, loss, train_set, _, _ = _fold_parts(job["work"], job["fold"], size=job["image_size"])
    cfg = TrainConfig(
        **{**RECIPE["train"], "iters_per_epoch": job["iters_per_epoch"]},
        max_epochs=job["epochs"],
        eval_every=1,
        patience=None,
        num_workers=job["workers"],
        seed=job["fold"],
        device=job["device"],
        amp=job["amp"],
        amp_dtype="bfloat16",
    )
    marks = []
    t_start = time.time()

    def on_eval(rec):
        marks.append({"epoch": rec["epoch"], "time": time.time(), "train_loss": rec["train_loss"]})

    res = train_fold(model, loss, train_set, None, cfg, on_eval=on_eval)
    batch = cfg.classes_per_batch * cfg.m
    steady = marks[1:] if len(marks) > 1 else marks
    t0 = marks[0]["time"] if len(marks) > 1 else t_start
    imgs = batch * cfg.iters_per_epoch * len(steady)
    out = {
        "status": res.status,
        "reason": res.reason,
        "epochs": len(marks),
        "first_epoch_s": round(marks[0]["time"] - t_start, 2) if marks else None,
        "steady_start": t0,
        "steady_end": marks[-1]["time"] if marks else None,
        "images_per_s": round(imgs / (marks[-1]["time"] - t0), 1) if marks else None,
        "train_loss_last": marks[-1]["train_loss"] if marks else None,
    }
    if job["device"].startswith("cuda"):
        out["torch_max_allocated_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
        out["torch_max_reserved_mib"] = round(torch.cuda.max_memory_reserved() / 2**20)
    return out


def child_gpu(job: dict) -> dict:
    """The training step alone on batches already on the device: forward, loss, backward, optimiser steps."""
    import torch

    from dml_core.training.loop import TrainConfig, _optimizer

    model, loss, _, _, _ = _fold_parts(job["work"], 0, size=job["image_size"])
    device = torch.device(job["device"])
    model.to(device).train()
    loss.to(device)
    cfg = TrainConfig(**RECIPE["train"], device=job["device"])
    opt = _optimizer(model, loss, cfg)
    size = job["image_size"]
    batch = cfg.classes_per_batch * cfg.m
    x = torch.randn(batch, 3, size, size, device=device) * 60
    y = torch.arange(batch, device=device) // cfg.m
    result = {}
    for amp in (False, True):

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                emb = model(x)
            value = loss(emb.float(), y)
            opt.zero_grad(set_to_none=True)
            value.backward()
            opt.step()
            return value

        for _ in range(job["warmup"]):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(job["iters"]):
            v = step()
            v.item()  # train_fold reads the loss every iteration (divergence check): the same sync
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / job["iters"]
        key = "bf16" if amp else "fp32"
        result[key] = {"ms_per_iter": round(dt * 1e3, 2), "images_per_s": round(batch / dt, 1)}
        if device.type == "cuda":
            result[key]["torch_max_allocated_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
    return result


def child_eval(job: dict) -> dict:
    """Validation and test embeddings (fp32, as folds evaluate; and bf16 autocast for the comparison) and their
    metrics, timed apart."""
    import numpy as np
    import torch

    from dml_core.evaluation.metrics import retrieval_metrics
    from dml_core.training.loop import embed

    torch.set_num_threads(int(job.get("threads", 2)))
    model, _, _, val_set, test_set = _fold_parts(job["work"], 0, size=job["image_size"])
    device = torch.device(job["device"])
    model.to(device)
    bs = RECIPE["train"]["eval_batch_size"]
    out: dict = {"val_images": len(val_set), "test_images": len(test_set), "workers": job["workers"]}
    t_cold = time.perf_counter()
    embed(model, val_set, batch_size=bs, num_workers=job["workers"])  # a first pass: CUDA kernels load, caches fill
    out["val_first_pass_s"] = round(time.perf_counter() - t_cold, 2)
    for name, ds in (("val", val_set), ("test", test_set)):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        emb, labels = embed(model, ds, batch_size=bs, num_workers=job["workers"])
        t1 = time.perf_counter()
        metrics = retrieval_metrics(emb.to(device), labels.to(device))
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        out[name] = {
            "embed_s": round(t1 - t0, 2),
            "images_per_s": round(len(ds) / (t1 - t0), 1),
            "metrics_s": round(t2 - t1, 3),
            "map_at_r": round(metrics["map_at_r"], 4),
        }
        if name == "val":  # the same embeddings under bf16 autocast: how far they move, and the metric

            class _Bf16(torch.nn.Module):
                def __init__(self, m):
                    super().__init__()
                    self.m = m

                def forward(self, xb):
                    with torch.autocast(device.type, dtype=torch.bfloat16):
                        return self.m(xb).float()

            wrapped = _Bf16(model)
            emb16, _ = embed(wrapped, ds, batch_size=bs, num_workers=job["workers"])
            a = torch.nn.functional.normalize(emb, dim=1)
            b = torch.nn.functional.normalize(emb16, dim=1)
            cos = (a * b).sum(1)
            m16 = retrieval_metrics(emb16.to(device), labels.to(device))
            out["val_bf16"] = {
                "cosine_min": round(float(cos.min()), 5),
                "cosine_mean": round(float(cos.mean()), 6),
                "map_at_r": round(m16["map_at_r"], 4),
                "map_at_r_diff": round(m16["map_at_r"] - metrics["map_at_r"], 4),
            }
    out["labels_checked"] = bool(np.array_equal(labels.numpy(), np.asarray(test_set.labels)))
    return out


def child_decode(job: dict) -> dict:
    """One core: shard bytes (cache and sha256 check included), decode, train / eval transform, per image."""
    import numpy as np
    import torch

    from dml_core.data import decode_image, eval_transform, train_transform

    torch.set_num_threads(1)
    model, _, train_set, _, _ = _fold_parts(job["work"], 0, with_weights=False)
    table = train_set.table
    size = RECIPE["image_size"]
    tt, et = train_transform(size, model.preprocessing), eval_transform(size, model.preprocessing)
    rng = np.random.default_rng(0)
    rows = rng.choice(len(table), size=min(job["n"], len(table)), replace=False)
    t0 = time.perf_counter()
    raw = [table.images[int(i)] for i in rows]
    t1 = time.perf_counter()
    imgs = [decode_image(b) for b in raw]
    t2 = time.perf_counter()
    for im in imgs:
        tt(im)
    t3 = time.perf_counter()
    for im in imgs:
        et(im)
    t4 = time.perf_counter()
    n = len(rows)
    per = {
        "read": (t1 - t0) / n,
        "decode": (t2 - t1) / n,
        "train_transform": (t3 - t2) / n,
        "eval_transform": (t4 - t3) / n,
    }
    return {
        "images": n,
        "ms_per_image": {k: round(v * 1e3, 3) for k, v in per.items()},
        "train_images_per_s_per_core": round(1 / (per["read"] + per["decode"] + per["train_transform"]), 1),
        "eval_images_per_s_per_core": round(1 / (per["read"] + per["decode"] + per["eval_transform"]), 1),
        "mean_pixels": int(np.mean([im.width * im.height for im in imgs])),
    }


def child_accuracy(job: dict) -> dict:
    """bench/cpu_speed_bench.py's accuracy check (its data and its ``accuracy``), on CUDA: final val MAP@R."""
    import torch

    import bench.cpu_speed_bench as cpu_bench

    torch.set_num_threads(1)
    omni = Path(job["omniglot"])
    _, train, val, n_train = cpu_bench.data(omni.is_dir(), omni)
    variant = {"device": job["device"], "amp": job["amp"], "num_workers": 2}
    map_at_r, seconds = cpu_bench.accuracy(train, val, n_train, variant, job["seed"], job["epochs"])
    return {
        "status": "ok",
        "map_at_r": map_at_r,
        "seconds": round(seconds, 1),
        "data": "omniglot" if omni.is_dir() else "synthetic",
    }


CHILDREN = {
    "fold": child_fold,
    "gpu": child_gpu,
    "eval": child_eval,
    "decode": child_decode,
    "accuracy": child_accuracy,
}


# ------------------------------------------------------------------------------------------------- parent steps
def _fold_jobs(a, n: int, workers: int, amp: bool) -> list[dict]:
    return [
        {
            "kind": "fold",
            "work": str(a.work),
            "fold": i,
            "epochs": a.epochs,
            "workers": workers,
            "amp": amp,
            "device": _device(a.cpu),
            "threads": 2,
            "image_size": a.image_size,
            "iters_per_epoch": a.iters_per_epoch,
        }
        for i in range(n)
    ]


def _run_folds(a, out: Path, sampler: GpuSampler, n: int, workers: int, amp: bool) -> dict:
    t0 = time.time()
    res = _children(_fold_jobs(a, n, workers, amp), out, timeout=a.fold_timeout)
    bad = [r.get("error") or f"{r.get('status')}: {r.get('reason')}" for r in res if r.get("status") != "ok"]
    rates = [r["images_per_s"] for r in res if r.get("images_per_s")]
    starts = [r["steady_start"] for r in res if r.get("steady_start")]
    ends = [r["steady_end"] for r in res if r.get("steady_end")]
    # the window in which every fold was past its first epoch and none had finished
    window = sampler.window(max(starts), min(ends)) if starts and ends and max(starts) < min(ends) else {}
    summary = {
        "folds": n,
        "workers_per_fold": workers,
        "amp": "bf16" if amp else "fp32",
        "images_per_s_per_fold": [round(r, 1) for r in rates],
        "images_per_s_total": round(sum(rates), 1),
        "first_epoch_s": [r.get("first_epoch_s") for r in res],
        "torch_max_reserved_mib": [r.get("torch_max_reserved_mib") for r in res],
        "nvidia_smi_mem_mib": [r.get("nvidia_smi_mem_mib") for r in res],
        "wall_s": round(time.time() - t0, 1),
        **window,
    }
    if bad:
        summary["errors"] = bad
    _log(
        f"{n} fold(s), {workers} workers, {summary['amp']}: {summary['images_per_s_total']} img/s total "
        f"({summary['images_per_s_per_fold']}), GPU util {window.get('gpu_util_mean')} %"
        + (f"  ERRORS {bad}" if bad else "")
    )
    return summary


def step_workers(a, out, sampler) -> list[dict]:
    counts = (1, 2) if a.quick else (2, 4, 8)
    return [_run_folds(a, out, sampler, 1, w, amp=not a.cpu) for w in counts]


def step_share(a, out, sampler) -> list[dict]:
    # one fold alone is the workers step's run with the preset's 4 workers
    shares = a.share_folds or ((2,) if a.quick else (2, 4))
    workers = a.share_workers or [1 if a.quick else RECIPE["num_workers"]] * len(shares)
    amp = not a.cpu and a.share_precision == "bf16"
    return [_run_folds(a, out, sampler, n, w, amp=amp) for n, w in zip(shares, workers)]


def step_amp(a, out, sampler) -> list[dict]:
    workers = 1 if a.quick else RECIPE["num_workers"]
    return [_run_folds(a, out, sampler, 1, workers, amp=False)]


def step_gpu(a, out, sampler) -> dict:
    job = {"kind": "gpu", "work": str(a.work), "device": _device(a.cpu), "warmup": 3 if a.quick else 20}
    job["image_size"] = a.image_size
    job["iters"] = 3 if a.quick else 100
    res = _children([job], out, timeout=a.fold_timeout)[0]
    _log(f"gpu step alone: {res}")
    return res


def step_decode(a, out, sampler) -> dict:
    res = _children([{"kind": "decode", "work": str(a.work), "n": 60 if a.quick else 600}], out, timeout=300)[0]
    _log(f"decode per core: {res}")
    return res


def step_eval(a, out, sampler) -> list[dict]:
    results = []
    for workers in (1,) if a.quick else (RECIPE["num_workers"],):
        job = {"kind": "eval", "work": str(a.work), "device": _device(a.cpu), "workers": workers, "threads": 2}
        job["image_size"] = a.image_size
        res = _children([job], out, timeout=a.fold_timeout)[0]
        _log(f"eval ({workers} workers): {res}")
        results.append(res)
    return results


def step_accuracy(a, out, sampler) -> dict:
    seeds = range(1 if a.quick else 4)
    jobs = [
        {
            "kind": "accuracy",
            "omniglot": str(a.omniglot),
            "seed": s,
            "epochs": 1 if a.quick else 4,
            "amp": amp,
            "device": _device(a.cpu),
        }
        for amp in (False, True)
        for s in seeds
    ]
    res = _children(jobs, out, timeout=a.fold_timeout)
    fp32 = [r.get("map_at_r") for r, j in zip(res, jobs) if not j["amp"]]
    bf16 = [r.get("map_at_r") for r, j in zip(res, jobs) if j["amp"]]
    summary = {"fp32": fp32, "bf16": bf16, "data": res[0].get("data"), "seconds": [r.get("seconds") for r in res]}
    if all(v is not None for v in fp32 + bf16) and len(fp32) > 1:
        sd = statistics.stdev(fp32)
        diff = statistics.fmean(bf16) - statistics.fmean(fp32)
        summary.update(
            fp32_mean=round(statistics.fmean(fp32), 4),
            fp32_sd=round(sd, 4),
            bf16_mean=round(statistics.fmean(bf16), 4),
            diff=round(diff, 4),
            within_noise=abs(diff) <= 2 * sd,
        )
    _log(f"accuracy: {summary}")
    return summary


#: configs/mlrc-cub200.yaml's budget: 15 losses, 50 trials, 4 folds, 10 reproductions, validation every 2 epochs.
PRESET = {"losses": 15, "trials": 50, "folds": 4, "reproductions": 10, "eval_every": 2}


def project(summaries: list[dict], epochs=(20, 50, 100), gpus=(1, 8)) -> str:
    """GPU-hours and wall time of the whole CUB preset from measured runs (``summary.json`` files): the four-fold
    share run (fp32, the preset's precision; bf16 if no fp32 one), the validation and test evaluation times and the
    first epoch's extra time.  Epochs per fold are an assumption (MLRC stops a fold 10 epochs after its best: best
    epoch 10 / 40 / 90 → 20 / 50 / 100 epochs); every fold's time on the GPU is its wall time over the folds sharing
    it, since the folds train and evaluate side by side."""
    shares = [r for s in summaries for r in s.get("share") or [] if r.get("folds") == 4 and not r.get("errors")]
    share = next((r for r in shares if r["amp"] == "fp32"), shares[0] if shares else None)
    ev = next((e for s in summaries for e in s.get("eval") or [] if "val" in e), None)
    if share is None or ev is None:
        return "projection: needs a 4-fold share run and an eval run"
    n, rate = share["folds"], share["images_per_s_total"] / share["folds"]
    batch, iters = RECIPE["train"]["classes_per_batch"] * RECIPE["train"]["m"], RECIPE["train"]["iters_per_epoch"]
    epoch_s = batch * iters / rate
    val_s = ev["val"]["embed_s"] + ev["val"]["metrics_s"]
    test_s = ev["test"]["embed_s"] + ev["test"]["metrics_s"]
    first_extra = max(0.0, statistics.fmean(share["first_epoch_s"]) - epoch_s)
    p = PRESET
    search_folds = p["losses"] * p["trials"] * p["folds"]
    repro_folds = p["losses"] * p["reproductions"] * p["folds"]
    lines = [
        f"Projection for configs/mlrc-cub200.yaml ({p['losses']} losses × ({p['trials']} trials + "
        f"{p['reproductions']} reproductions) × {p['folds']} folds = {search_folds + repro_folds} folds), "
        f"{n} folds per GPU at {rate:.0f} images/s each ({share['amp']}): {epoch_s:.2f} s an epoch, "
        f"validation {val_s:.2f} s every {p['eval_every']} epochs, test {test_s:.2f} s, first-epoch extra "
        f"{first_extra:.2f} s",
        "",
        "| epochs per fold | GPU-hours | " + " | ".join(f"wall on {g} GPU{'s' if g > 1 else ''}" for g in gpus) + " |",
        "|---|---|" + "---|" * len(gpus),
    ]
    for e in epochs:
        fold_wall = e * (epoch_s + val_s / p["eval_every"]) + val_s + first_extra  # epoch 0 is evaluated too
        gpu_s = (search_folds + repro_folds) * fold_wall / n + repro_folds * test_s / n
        hours = gpu_s / 3600
        lines.append(f"| {e} | {hours:.0f} | " + " | ".join(f"{hours / g:.1f} h" for g in gpus) + " |")
    return "\n".join(lines)


def _markdown(summary: dict) -> str:
    lines = [f"# gpu_cub_check — {summary['device']}", ""]
    for key in ("workers", "share", "amp"):
        rows = summary.get(key) or []
        if not rows:
            continue
        lines += [
            f"## {key}",
            "",
            "| folds | workers/fold | precision | img/s per fold | img/s total | GPU util mean % "
            "| GPU memory per fold (nvidia-smi MiB) |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['folds']} | {r['workers_per_fold']} | {r['amp']} | {r['images_per_s_per_fold']} | "
                f"{r['images_per_s_total']} | {r.get('gpu_util_mean')} | {r['nvidia_smi_mem_mib']} |"
            )
        lines.append("")
    for key in ("data", "decode", "gpu", "eval", "accuracy"):
        if key in summary:
            lines += [f"## {key}", "", "```", json.dumps(summary[key], indent=1), "```", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gpu-cub"))
    ap.add_argument("--work", type=Path, default=None, help="where the dataset and shards go (default: <out>/work)")
    ap.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    ap.add_argument(
        "--epochs", type=int, default=3, help="epochs of 100 iterations per measured fold (first = warm-up)"
    )
    ap.add_argument("--cpu", action="store_true", help="rehearse on the CPU (no GPU figures)")
    ap.add_argument("--quick", action="store_true", help="a small dataset and short runs (a rehearsal)")
    ap.add_argument("--deadline", type=float, default=540, help="seconds after which no further step starts")
    ap.add_argument("--fold-timeout", type=float, default=240)
    ap.add_argument("--share-folds", type=int, nargs="+", default=None, help="share: fold counts (default 2 4)")
    ap.add_argument(
        "--share-workers",
        type=int,
        nargs="+",
        default=None,
        help="share: DataLoader workers per fold, one per fold count (default the preset's 4)",
    )
    ap.add_argument("--share-precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--omniglot", type=Path, default=ROOT.parent / "shared" / "data" / "omniglot")
    ap.add_argument(
        "--project",
        type=Path,
        nargs="+",
        default=None,
        metavar="SUMMARY",
        help="print the preset's projected cost from these summary.json files and exit",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    # a rehearsal trains small images for a few iterations an epoch; a real run uses the recipe's
    a.image_size = 64 if a.quick else RECIPE["image_size"]
    a.iters_per_epoch = 4 if a.quick else RECIPE["train"]["iters_per_epoch"]
    if a.project:
        print(project([json.loads(p.read_text()) for p in a.project]))
        return 0
    if a.child:
        job = json.loads(a.child)
        try:
            res = CHILDREN[job["kind"]](job)
        except Exception as e:  # the parent reports it beside the other measurements
            import traceback

            traceback.print_exc()
            res = {"error": f"{type(e).__name__}: {e}"}
        Path(a.child_out).write_text(json.dumps(res))
        return 0

    a.out.mkdir(parents=True, exist_ok=True)
    a.work = (a.work or a.out / "work").resolve()
    a.work.mkdir(parents=True, exist_ok=True)
    a.out = a.out.resolve()
    t_start = time.time()
    import torch

    summary: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "recipe": RECIPE,
        "image_size": a.image_size,
        "iters_per_epoch": a.iters_per_epoch,
        "epochs_per_fold": a.epochs,
        "skipped": [],
    }
    fns = {"data": lambda: step_data(a, a.out)}
    with GpuSampler() as sampler:
        for step in STEPS:
            if step not in a.steps:
                continue
            if time.time() - t_start > a.deadline:
                summary["skipped"].append(step)
                _log(f"{step}: skipped (past the {a.deadline:.0f} s deadline)")
                continue
            t0 = time.time()
            _log(f"== {step}")
            try:
                if step in fns:
                    summary[step] = fns[step]()
                else:
                    summary[step] = globals()[f"step_{step}"](a, a.out, sampler)
            except Exception as e:  # later steps may still run; the summary says what failed
                summary[step] = {"error": f"{type(e).__name__}: {e}"}
                _log(f"{step} FAILED: {e}")
                if step == "data":  # every later step reads its shards
                    break
            summary.setdefault("step_seconds", {})[step] = round(time.time() - t0, 1)
            (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    summary["total_s"] = round(time.time() - t_start, 1)
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    text = _markdown(summary) + "\n" + project([summary]) + "\n"
    (a.out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
