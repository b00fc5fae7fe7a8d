"""Benchmark: the time the study visuals (pipelines.results.visuals) add to a study, and their peak memory.

At the end of a study ``log_study_visuals`` runs once, sequentially, after the CIs: it reads reproduction 0's four
fold checkpoints (test embeddings), runs ``retrieval_details`` (one exact kNN search), decodes the gallery's images
from the dataset table by row, draws the gallery and the PCA map, and logs six artifacts to MLflow.  Its wall time is
therefore exactly what a study gains.  This script builds that input at a preset's size — the dataset table the
preset reads, its test classes (``trainval_test_split``), four fold embeddings of the preset's ``embedding_dim``
with class structure plus noise (the cost does not depend on how well a model was trained) — and times
``log_study_visuals`` against a sqlite MLflow store, ``--repeat`` times (the first run includes imports):

    python bench/visuals_bench.py --preset demo
    python bench/visuals_bench.py --preset omniglot --omniglot-src /path/to/omniglot-zips   # prepared to shards first
    python bench/visuals_bench.py --preset synthetic --classes 5000 --per-class 12           # SOP-size test set (60k)
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _table(args, tmp: Path):
    from dml_core import data

    if args.preset == "demo":  # pipelines/config/demo.yaml: synthetic 32 × 12, 16 px, embedding_dim 32
        return data.synthetic(32, 12, 16, 0), 32
    if args.preset == "synthetic":
        return data.synthetic(2 * args.classes, args.per_class, 16, 0), args.dim
    # configs/omniglot.yaml: the prepared shards (a streaming ShardedTable), embedding_dim 64
    from dml_core.datasets import prepare

    dest = tmp / "omniglot"
    t0 = time.time()
    prepare("omniglot", args.omniglot_src, dest, progress=False)
    print(f"(prepared omniglot shards in {time.time() - t0:.1f} s; not part of the measurement)")
    return data.read_parquet_manifest(str(dest), cache_dir=tmp / "cache"), 64


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=("demo", "omniglot", "synthetic"), default="demo")
    ap.add_argument(
        "--omniglot-src",
        default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "omniglot"),
        help="folder with Omniglot's images_background_small*.zip (--preset omniglot)",
    )
    ap.add_argument("--classes", type=int, default=5000, help="test classes (--preset synthetic)")
    ap.add_argument("--per-class", type=int, default=12, help="images per class (--preset synthetic)")
    ap.add_argument("--dim", type=int, default=128, help="embedding_dim per fold model (--preset synthetic)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    from dml_core.splits import trainval_test_split
    from pipelines.results.visuals import log_study_visuals
    from pipelines.tracking.runs import Tracker

    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        table, dim = _table(args, tmp)
        _, test_classes = trainval_test_split(np.asarray(table.labels))
        labels = np.asarray(table.labels)[np.isin(table.labels, test_classes)]
        rng = np.random.default_rng(0)
        ckpts = []
        for k in range(4):  # four fold models' test embeddings, as pipelines/execution/folds/fold.py writes them
            centres = rng.normal(size=(int(labels.max()) + 1, dim)).astype(np.float32)
            emb = centres[labels] + 1.5 * rng.normal(size=(len(labels), dim)).astype(np.float32)
            d = tmp / f"fold{k}"
            d.mkdir()
            np.save(d / "test_embeddings.npy", emb)
            np.save(d / "test_labels.npy", labels)
            ckpts.append(str(d))
        del emb
        plan = types.SimpleNamespace(
            key=f"{args.preset}/bench",
            dataset=types.SimpleNamespace(
                table=table, manifest=types.SimpleNamespace(test_classes=tuple(int(c) for c in test_classes))
            ),
        )
        tracker = Tracker.open(f"sqlite:///{tmp / 'mlflow.db'}", "bench", (tmp / "art").as_uri())
        print(
            f"preset {args.preset}: {len(labels)} test images, {len(test_classes)} test classes, "
            f"concatenated embedding 4 × {dim}"
        )
        times = []
        for i in range(args.repeat):
            run_id, _ = tracker.get_or_create({"stage": "study", "i": i})
            rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            t0 = time.time()
            seconds = log_study_visuals(tracker, run_id, plan, [{"fold_checkpoints": ckpts}])
            wall = time.time() - t0
            if seconds is None:
                print("visuals failed:", tracker.run(run_id).data.tags.get("visuals.error"))
                return 1
            times.append(wall)
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            sizes = {a.path.split("/")[-1]: a.file_size for a in tracker.client.list_artifacts(run_id, "visuals")}
            print(
                f"run {i}: {wall:.2f} s  (peak RSS so far {rss / 1024:.0f} MB, +{(rss - rss0) / 1024:.0f} MB this run)"
                f"  artifacts: " + ", ".join(f"{k} {v / 1024:.0f} kB" for k, v in sorted(sizes.items()))
            )
        print(
            f"added time per study: first {times[0]:.2f} s (with imports), then median "
            f"{float(np.median(times[1:] or times)):.2f} s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
