"""The production path on a GPU machine, in one command: CUDA tests, a warm-fold sweep and a Ray Train (NCCL) fold
on the GPU, the symmetric kNN at gallery scale on CUDA, and ``dmlrc reeval`` with GPU actors.

    python bench/gpu_check.py --out gpu-check            # every step
    python bench/gpu_check.py --steps warm reeval        # some steps (reeval needs warm's registered models)

Each step runs as its own subprocess with a time limit, its full output in ``<out>/<step>.log``; the summary
(``<out>/summary.json`` and the last lines printed) says what ran, on which card, how long it took and what
each check found.  Exit status 0 only when every step asked for passed.  ``bench/README_gpu.md`` holds the
results of a run.

Steps:

* ``tests``:  ``tests/test_cuda.py`` and the CUDA tests of ``tests/test_knn.py`` / ``tests/test_metrics.py``;
* ``warm``:   the built-in demo preset (``pipelines/config/demo.yaml``) on the same synthetic classes written as parquet
  shards, ``use_gpu: true`` with ``gpus_per_worker: 0.25`` (four folds share one GPU) on warm Ray worker
  processes; checks every fold run's ``device`` tag is CUDA, that a process served several folds, and that the
  CI table was printed;
* ``train``:  one short study (1 trial, 2 k-fold folds, 2 reproductions) with ``fold_executor: train`` and
  ``workers_per_fold: 1``: Ray Train folds with ``use_gpu`` (``torch.distributed`` on NCCL, world size 1, four
  folds sharing the GPU); checks the fold runs' ``dist_backend`` tag;
* ``knn``:    ``bench/metrics_bench.py --sides ours-cuda`` at 100k and 1M × 128;
* ``reeval``: ``dmlrc reeval`` of the warm sweep's registered models with ``use_gpu: true``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("tests", "warm", "train", "knn", "reeval")
DATASET = "shapes"
#: Seconds each step may take by default (``--timeout`` overrides them all): together they fit a 10-minute call.
TIMEOUTS = {"tests": 150, "warm": 150, "train": 120, "knn": 100, "reeval": 90}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(name: str, cmd: list[str], out: Path, timeout: float, cwd: Path | None = None) -> dict:
    """Run one step's command; its output goes to <out>/<name>.log.  Returns rc and wall time."""
    t0 = time.time()
    log = out / f"{name}.log"
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(), cwd=cwd or ROOT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # Ctrl-C first (a sweep then stops its Ray), then the whole group
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = 124
    wall = time.time() - t0
    tail = log.read_text(errors="replace").splitlines()[-25:]
    print(f"== {name}: rc {rc}, {wall:.1f} s", flush=True)
    print("\n".join("   " + line for line in tail), flush=True)
    return {"rc": rc, "wall_s": round(wall, 1), "command": " ".join(cmd)}


def _parquet(dest: Path, num_classes: int, per_class: int, image_size: int) -> str:
    """The demo's synthetic classes as parquet shards (what ``dmlrc data prepare`` writes), so that ``reeval``
    can read the registered models' test classes back."""
    from PIL import Image

    from dml_core.data import synthetic
    from dml_core.shards import MANIFEST_NAME, Record, write_shards

    if (dest / MANIFEST_NAME).is_file():  # written by an earlier run of this script
        return str(dest)
    table = synthetic(num_classes, per_class, image_size, 0)

    def png(img):
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="PNG")
        return buf.getvalue()

    labels = [int(v) for v in table.labels]
    records = [
        Record(f"img_{i:05d}.png", labels[i], f"class_{labels[i]:03d}", "all", (lambda img=table.images[i]: png(img)))
        for i in range(len(labels))
    ]
    write_shards(records, str(dest), dataset="synthetic-shards", progress=False)
    return str(dest)


def _sweep_config(
    work: Path,
    name: str,
    data: str,
    *,
    executor: str,
    gpus_per_worker: float,
    use_gpu: bool,
    losses: list | None = None,
    trials: int | None = None,
) -> Path:
    for old in (work / f"{name}.db", work / "runs" / name):  # a fresh sweep each time
        if old.is_dir():
            shutil.rmtree(old)
        elif old.exists():
            old.unlink()
    doc = yaml.safe_load((ROOT / "pipelines" / "config" / "demo.yaml").read_text())
    size = doc["datasets"][0]["image_size"]
    doc["name"] = name
    doc["datasets"] = [{"name": DATASET, "kind": "parquet", "path": data, "image_size": size}]
    if losses is not None:
        doc["losses"] = losses
    if trials is not None:  # the short form: 1 trial, 2 k-fold folds, 2 reproductions
        doc["protocol"].update(
            trials=trials,
            startup_trials=min(trials, doc["protocol"]["startup_trials"]),
            folds=2,
            fold_layout="kfold",
            reproductions=2,
        )
        doc["resources"]["max_concurrent_trials"] = 2
    doc["resources"].update(use_gpu=use_gpu, gpus_per_worker=gpus_per_worker, fold_executor=executor)
    doc["tracking"] = {"uri": f"sqlite:///{work / (name + '.db')}", "experiment": name}
    doc["storage"] = str(work / "runs")
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _fold_runs(uri: str, experiment: str) -> list:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    return [
        r
        for r in client.search_runs([exp.experiment_id], max_results=5000)
        if r.data.tags.get("stage") == "fold" or r.info.run_name.startswith("fold ")
    ]


def _check_folds(uri: str, experiment: str) -> dict:
    runs = _fold_runs(uri, experiment)
    tags = [r.data.tags for r in runs]
    pids = [t.get("pid") for t in tags]
    return {
        "fold_runs": len(runs),
        "devices": sorted({t.get("device", "?") for t in tags}),
        "gpu_names": sorted({t.get("gpu_name", "-") for t in tags}),
        "dist_backends": sorted({t.get("dist_backend", "-") for t in tags}),
        "processes": len(set(pids)),
        "max_folds_per_process": max((pids.count(p) for p in set(pids)), default=0),
        "all_on_cuda": bool(runs) and all(t.get("device", "").startswith("cuda") for t in tags),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu-check", help="folder for the logs and summary.json")
    ap.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000], help="knn step's N")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per step (default: TIMEOUTS)")
    ap.add_argument("--repeats", type=int, default=1, help="knn step: runs per size")
    ap.add_argument(
        "--cpu",
        action="store_true",
        help="rehearse the steps on a machine without a GPU (use_gpu off; the CUDA checks then fail)",
    )
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    work.mkdir(exist_ok=True)

    import torch

    summary: dict = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "steps": {},
    }
    print(f"torch {summary['torch']} (CUDA {summary['cuda']}), GPU: {summary['gpu']}", flush=True)
    py = sys.executable
    doc = yaml.safe_load((ROOT / "pipelines" / "config" / "demo.yaml").read_text())
    ds = doc["datasets"][0]
    data = None
    if {"warm", "train", "reeval"} & set(args.steps):
        data = _parquet(work / "data", ds["num_classes"], ds["per_class"], ds["image_size"])

    for step in args.steps:
        limit = args.timeout or TIMEOUTS[step]
        if step == "tests":
            r = _run(
                "tests",
                [
                    py,
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "tests/test_cuda.py",
                    "tests/test_knn.py",
                    "tests/test_metrics.py",
                    "-k",
                    "cuda or Cuda or CUDA",
                    "-rs",
                ],
                out,
                limit,
            )
        elif step == "warm":
            cfg = _sweep_config(work, "gpu-warm", data, executor="warm", gpus_per_worker=0.25, use_gpu=not args.cpu)
            r = _run("warm", [py, "-m", "pipelines.cli", "sweep", str(cfg)], out, limit, cwd=work)
            text = (out / "warm.log").read_text(errors="replace")
            r["ci_table_printed"] = "±" in text
            r.update(_check_folds(f"sqlite:///{work / 'gpu-warm.db'}", "gpu-warm"))
            r["ok"] = r["rc"] == 0 and r["all_on_cuda"] and r["max_folds_per_process"] > 1 and r["ci_table_printed"]
        elif step == "train":
            cfg = _sweep_config(
                work,
                "gpu-train",
                data,
                executor="train",
                gpus_per_worker=0.25,
                use_gpu=not args.cpu,
                losses=[{"name": "contrastive"}],
                trials=1,
            )
            r = _run("train", [py, "-m", "pipelines.cli", "sweep", str(cfg)], out, limit, cwd=work)
            r.update(_check_folds(f"sqlite:///{work / 'gpu-train.db'}", "gpu-train"))
            r["ok"] = r["rc"] == 0 and r["all_on_cuda"] and r["dist_backends"] == ["nccl"]
        elif step == "knn":
            r = _run(
                "knn",
                [
                    py,
                    "bench/metrics_bench.py",
                    "--sides",
                    "ours-cuda",
                    "--threads",
                    "1",
                    "--repeats",
                    str(args.repeats),
                    "--sizes",
                    *map(str, args.sizes),
                ],
                out,
                limit,
            )
        else:  # reeval
            conf = work / "reeval.yaml"
            conf.write_text(
                yaml.safe_dump(
                    {
                        "schedule": "gpu-check",
                        "tracking_uri": f"sqlite:///{work / 'gpu-warm.db'}",
                        "models": [{"experiment": "gpu-warm"}],
                        "datasets": {DATASET: data},
                        "tolerance": 0.01,
                        "use_gpu": not args.cpu,
                        "out": str(work / "reeval-out"),
                    }
                )
            )
            r = _run("reeval", [py, "-m", "pipelines.cli", "reeval", str(conf)], out, limit, cwd=work)
        r.setdefault("ok", r["rc"] == 0)
        summary["steps"][step] = r
        (out / "summary.json").write_text(json.dumps(summary, indent=1))

    print(json.dumps(summary, indent=1))
    return 0 if all(r["ok"] for r in summary["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
