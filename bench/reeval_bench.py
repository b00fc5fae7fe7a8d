"""Re-evaluation throughput on the Omniglot shards: images/s embedded through Ray Data, and the metric time.

    python bench/reeval_bench.py [--omniglot ../shared/data/omniglot] [--reproductions 2] [--size 32]
                                 [--trunk tiny] [--dim 64] [--batch 256] [--cpus 2]

Prepares the Omniglot zips as parquet shards (``dmlrc data prepare omniglot``) in a temp dir, logs ``--reproductions``
pyfunc models (4 untrained fold models each, :mod:`pipelines.tracking.pyfunc_model`) to a local MLflow store, then runs
``dmlrc reeval``'s own steps on *every* class of the dataset as the test set:

* embed: :func:`pipelines.reeval.embed.embed_version` (Ray Data ``read_parquet`` → ``map_batches`` with model-holding
  actors; every image goes through every reproduction's 4 fold models) — reported as images/s and
  model-forward images/s (images × reproductions × folds);
* metrics: :func:`pipelines.reeval.reproduction_metrics` per reproduction (the sweep's test step).

Untrained weights: throughput does not depend on them.  Prints measured numbers only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--omniglot", default=os.environ.get("DMLRC_OMNIGLOT", str(ROOT.parent / "shared" / "data" / "omniglot"))
    )
    ap.add_argument("--reproductions", type=int, default=2)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--trunk", default="tiny")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--cpus", type=int, default=2)
    args = ap.parse_args()
    if not Path(args.omniglot).is_dir():
        print(f"no Omniglot zips at {args.omniglot} (set --omniglot)")
        return 2

    import mlflow
    import ray
    import torch

    from dml_core.models import build_model
    from dml_core.shards import read_manifest
    from pipelines.reeval.config import ReevalConfig, Target
    from pipelines.reeval.embed import embed_version
    from pipelines.reeval.run import reproduction_metrics
    from pipelines.tracking import pyfunc_model
    from pipelines.tracking.model_registry import _signature

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.time()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pipelines.cli",
                "data",
                "prepare",
                "omniglot",
                "--src",
                args.omniglot,
                "--dest",
                str(tmp / "shards"),
                "--no-progress",
            ],
            check=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL,
        )
        manifest = read_manifest(tmp / "shards")
        print(
            f"prepared {manifest['num_images']} images, {len(manifest['classes'])} classes, "
            f"{len(manifest['shards'])} shards in {time.time() - t0:.1f} s"
        )

        uri = f"sqlite:///{tmp / 'mlflow.db'}"
        mlflow.set_tracking_uri(uri)
        kwargs = {"trunk": args.trunk, "embedding_dim": args.dim, "freeze_bn": False}
        reps = []
        with mlflow.start_run():
            for i in range(args.reproductions):
                arts = {}
                for k in range(4):
                    torch.manual_seed(100 * i + k)
                    p = tmp / f"r{i}f{k}.pt"
                    torch.save(build_model(**kwargs).state_dict(), p)
                    arts[pyfunc_model.fold_artifact(k)] = str(p)
                spec = tmp / f"r{i}.json"
                spec.write_text(
                    json.dumps({"model_kwargs": kwargs, "folds": 4, "image_size": args.size, "embedding_dim": args.dim})
                )
                arts["embedder"] = str(spec)
                info = mlflow.pyfunc.log_model(
                    name=f"rep{i}",
                    python_model=pyfunc_model.__file__,
                    artifacts=arts,
                    signature=_signature(args.size, 4 * args.dim),
                    pip_requirements=["torch"],
                )
                reps.append({"reproduction": i, "seed": i, "model_uri": info.model_uri, "metrics": {}})
        classes = [int(c["label"]) for c in manifest["classes"]]
        target = Target("bench", "1", {"image_size": str(args.size)}, str(tmp / "shards"), manifest, classes, reps)
        cfg = ReevalConfig(schedule="bench", tracking_uri=uri, models=[], datasets={}, batch_size=args.batch)

        from pipelines.reeval.embed import start_ray

        os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
        ray.init(num_cpus=args.cpus, include_dashboard=False, logging_level="WARNING")
        try:
            start_ray(cfg)
            outputs, labels, seconds = embed_version(target, cfg)
        finally:
            ray.shutdown()
        n = len(labels)
        print(
            f"embed: {n} images × {args.reproductions} reproductions × 4 fold models ({args.trunk}, "
            f"{args.size}px, d={args.dim}) in {seconds:.2f} s → {n / seconds:.0f} images/s, "
            f"{n * args.reproductions * 4 / seconds:.0f} model-forward images/s (Ray Data, {args.cpus} CPUs)"
        )
        t0 = time.perf_counter()
        for out in outputs:
            reproduction_metrics(out, labels, 4)
        dt = time.perf_counter() - t0
        print(
            f"metrics: {dt:.2f} s for {args.reproductions} reproductions (4 separated + 1 concatenated "
            f"retrieval_metrics each, N={n}) → {dt / args.reproductions:.2f} s per reproduction"
        )
        print(
            f"python {sys.version.split()[0]}, torch {torch.__version__}, ray {ray.__version__}, "
            f"{os.cpu_count()} cores (shared machine: noisy)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
