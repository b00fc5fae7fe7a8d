"""Data-loading throughput: parquet shards vs an image-folder tree of the same JPEGs.

    python bench/data_bench.py [--images 2000] [--size 256] [--crop 227] [--workers 0]

Generates `--images` JPEGs (short side `--size` px, smooth random content so file sizes are photo-like) in
`--classes` class directories of a temp dir, prepares the same files as parquet shards (dml_core.shards), then
measures, in one process (= one DataLoader worker):

* bytes/s  — fetching the encoded bytes only (file read vs row-group read from the shard + sha256 check);
* img/s    — the full per-sample work of training: fetch + decode + `train_transform(crop)` (RandomResizedCrop,
             flip, ToTensor, Normalize), as `ImageDataset.__getitem__` does in a worker;

for two access patterns: `sequential` (row order) and `m-per-class` (the training sampler: batches of 8 classes ×
4 random images, `dml_core.training.samplers.MPerClassBatchSampler`).  With `--workers N` it also times a DataLoader
with N workers.  Files are in the page cache after generation (warm numbers: this measures format overhead, not disks).

It also prices the integrity checks, per image and per 10k rows, CPU time of one process:
the header-only check `prepare` used to do vs the full check it does now (`dml_core.shards.check_image`: header,
PNG chunk CRCs, complete decode), for these JPEGs and (with `--omniglot DIR`) Omniglot's PNGs; `check_rows` (the
preflight: manifest + stamped shard hashes + every row's header) and `verify_shards` (re-hash + decode everything).
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def make_jpegs(root: Path, n_images: int, n_classes: int, size: int, seed: int = 0) -> int:
    """Smooth random images (upsampled 6x6 colour fields + mild noise), short side `size`, JPEG quality 90."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    total = 0
    for i in range(n_images):
        c = i % n_classes
        w = int(size * rng.uniform(1.0, 1.5))
        small = rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)
        img = np.asarray(Image.fromarray(small).resize((w, size), Image.BICUBIC), dtype=np.int16)
        img = np.clip(img + rng.normal(0, 6, img.shape), 0, 255).astype(np.uint8)
        d = root / f"class_{c:04d}"
        d.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=90)
        (d / f"img_{i:05d}.jpg").write_bytes(buf.getvalue())
        total += buf.tell()
    return total


def prepare_shards(folder_table, dest: Path, row_group_rows: int) -> dict:
    from dml_core.shards import Record, write_shards

    recs = [
        Record(
            relpath=str(rel),
            label=int(label),
            class_name=folder_table.class_names[int(label)],
            split="train",
            read=(lambda p=p: Path(p).read_bytes()),
        )
        for p, rel, label in zip(folder_table.images, folder_table.meta["relpath"], folder_table.labels)
    ]
    return write_shards(recs, dest, dataset="bench", progress=False, row_group_rows=row_group_rows, overwrite=True)


def access_orders(labels: np.ndarray, n: int, seed: int = 0) -> dict[str, list[int]]:
    from dml_core.training.samplers import MPerClassBatchSampler

    sampler = MPerClassBatchSampler(labels, m=4, classes_per_batch=8, iters_per_epoch=-(-n // 32), seed=seed)
    mpc = [i for batch in sampler for i in batch][:n]
    return {"sequential": list(range(min(n, len(labels)))), "m-per-class": mpc}


def time_it(fn, indices) -> float:
    """Items per CPU-second of fn over indices, in this process (best of 2 passes).

    CPU time, not wall time: a worker's cost is what it burns on its core, and CPU time does not count the
    time other processes on a shared machine hold the core.  Everything here runs on one thread
    (torch.set_num_threads(1), pyarrow reads with use_threads=False, PIL decodes on the calling thread)."""
    best = float("inf")
    for _ in range(2):
        t0 = time.process_time()
        for i in indices:
            fn(i)
        best = min(best, time.process_time() - t0)
    return len(indices) / max(best, 1e-9)


def loader_rate(dataset, labels, workers: int, n: int) -> float:
    from dml_core.training.samplers import MPerClassBatchSampler

    sampler = MPerClassBatchSampler(labels, m=4, classes_per_batch=8, iters_per_epoch=-(-n // 32), seed=1)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=workers, persistent_workers=False)
    t0 = time.perf_counter()
    count = sum(len(y) for _, y in loader)
    return count / (time.perf_counter() - t0)


def per_item_cpu(fn, items) -> float:
    """CPU seconds per item of fn over items (best of 2 passes)."""
    best = float("inf")
    for _ in range(2):
        t0 = time.process_time()
        for x in items:
            fn(x)
        best = min(best, time.process_time() - t0)
    return best / max(len(items), 1)


def integrity_costs(folder, shard_dir: Path, cache: Path, omniglot: str | None) -> None:
    """What the integrity checks cost: prepare's old header check vs its full check; check_rows; verify."""
    from dml_core.shards import check_image, check_rows, verify_shards
    from dml_core.shards.images import image_header

    sets = [("JPEG (generated)", [Path(p).read_bytes() for p in folder.images])]
    if omniglot:
        from dml_core.datasets.omniglot import iter_zips

        sets.append(("PNG (Omniglot, 105x105 1-bit)", [data for _, data, _ in iter_zips(omniglot)]))
    print()
    print(
        "| prepare-time image check | images | header only (ms/img) | full: CRCs + decode (ms/img) "
        "| added per 10k images (s) |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, blobs in sets:
        head = per_item_cpu(lambda b: image_header(b, "bench"), blobs)
        full = per_item_cpu(lambda b: check_image(b, "bench"), blobs)
        print(f"| {name} | {len(blobs):,} | {head * 1e3:.3f} | {full * 1e3:.3f} | {(full - head) * 1e4:.2f} |")

    n = len(folder)
    check_rows(shard_dir, cache_dir=cache)  # stamps the shard hashes, as the first training read would
    t0 = time.process_time()
    check_rows(shard_dir, cache_dir=cache)
    rows_s = time.process_time() - t0
    t0 = time.process_time()
    check_rows(shard_dir, cache_dir=cache, hash_rows=True)
    rows_hash_s = time.process_time() - t0
    t0 = time.process_time()
    verify_shards(shard_dir, cache_dir=cache)
    verify_s = time.process_time() - t0
    print()
    print(f"| whole-dataset check ({n:,} rows) | CPU s | per 10k rows (s) |")
    print("|---|---:|---:|")
    for name, sec in (
        ("check_rows (headers; shard hashes stamped)", rows_s),
        ("check_rows(hash_rows=True) (+ every row's sha256)", rows_hash_s),
        ("verify_shards (re-hash shards + rows, decode every image)", verify_s),
    ):
        print(f"| {name} | {sec:.2f} | {sec / n * 1e4:.2f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--size", type=int, default=256, help="short side of the generated JPEGs")
    ap.add_argument("--crop", type=int, default=227, help="train_transform output size")
    ap.add_argument("--samples", type=int, default=640, help="samples timed per cell")
    ap.add_argument(
        "--row-group-rows",
        type=int,
        nargs="+",
        default=[64],
        help="shard row-group sizes to compare (default: the prepare default, 64)",
    )
    ap.add_argument("--workers", type=int, default=0, help="also time a DataLoader with this many workers")
    ap.add_argument("--workdir", default=None, help="where to generate (default: a temp dir, removed afterwards)")
    ap.add_argument("--omniglot", default=None, help="Omniglot zip dir: also price the checks on its PNGs")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)  # one worker = one core
    from dml_core.data import ImageDataset, decode_image, read_image_folder, read_parquet_manifest, train_transform

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="dmlrc-data-bench-"))
    try:
        t0 = time.perf_counter()
        if not (work / "folder").is_dir():
            make_jpegs(work / "folder", args.images, args.classes, args.size)
        gen_s = time.perf_counter() - t0
        folder = read_image_folder(work / "folder")
        nbytes = sum(os.path.getsize(p) for p in folder.images)
        sources = [("image folder", folder, None)]
        for rg in args.row_group_rows:
            t0 = time.perf_counter()
            manifest = prepare_shards(folder, work / f"shards-rg{rg}", rg)
            prep_s = time.perf_counter() - t0
            table = read_parquet_manifest(work / f"shards-rg{rg}", cache_dir=work / "cache")
            assert table.labels.tolist() == sorted(folder.labels.tolist())
            n_groups = sum(len(s["row_groups"]) for s in manifest["shards"])
            sources.append(
                (
                    f"parquet shards, {rg}-row groups",
                    table,
                    f"{len(manifest['shards'])} shard(s), {n_groups} row groups, prepared in {prep_s:.2f} s",
                )
            )

        print(
            f"# dml-reality-check data bench: {platform.machine()}, {os.cpu_count()} CPUs, "
            f"python {sys.version.split()[0]}, torch {torch.__version__}"
        )
        print(
            f"# {len(folder)} JPEGs, {len(folder.class_names)} classes, short side {args.size} px, "
            f"mean {nbytes / len(folder) / 1024:.1f} KiB (generated in {gen_s:.1f} s); train_transform({args.crop})"
        )
        for name, _, note in sources[1:]:
            print(f"# {name}: {note}")
        tf = train_transform(args.crop)
        rows = []
        for name, table, _ in sources:
            ds = ImageDataset(table, tf)
            if table is folder:

                def fetch(i, t=table):
                    with open(t.images[i], "rb") as f:
                        return f.read()
            else:

                def fetch(i, t=table):
                    return t.images[i]

            for pattern, idx in access_orders(table.labels, args.samples).items():
                torch.manual_seed(0)
                rows.append((name, pattern, time_it(fetch, idx), time_it(ds.__getitem__, idx)))
        decode_only = time_it(lambda i: decode_image(folder.images[i]), list(range(min(args.samples, len(folder)))))

        print()
        print("| source | access | bytes only (img/s) | fetch + decode + train_transform (img/s per worker) |")
        print("|---|---|---:|---:|")
        for name, pattern, b, full in rows:
            print(f"| {name} | {pattern} | {b:,.0f} | {full:,.0f} |")
        print(f"\nJPEG decode alone (PIL, from a path): {decode_only:,.0f} img/s per worker (CPU time)")
        if args.workers:
            for name, table, _ in sources:
                rate = loader_rate(ImageDataset(table, tf), table.labels, args.workers, args.samples)
                print(f"DataLoader, {args.workers} workers, m-per-class, {name}: {rate:,.0f} img/s (wall clock)")
        integrity_costs(folder, work / f"shards-rg{args.row_group_rows[-1]}", work / "cache", args.omniglot)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
