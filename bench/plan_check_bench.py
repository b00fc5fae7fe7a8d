"""``--plan`` against real sweeps' wall time, with 1, 2 and 4 folds in flight on this machine's cores.

    PYTHONPATH=$PWD .venv/bin/python bench/plan_check_bench.py [--cases 1,2,4] [--max-load 0.7] [--wait 300]
                                                                [--json out.json]

Each case is one small real sweep: the demo's network (synthetic data, 64 classes, the tiny trunk, 8 × 4 batches)
with the contrastive loss, 1 search trial + 2 reproductions × 4 folds = 12 warm folds of 6 epochs × 60 iterations
(patience beyond the cap, so every fold trains to it and the plan's upper bound is the real count), one trial at a
time, and ``resources.num_cpus`` = the case: the local Ray's logical CPUs place that many folds at once (1, 2 or all
4 of a trial), the others wait in its queue.

Per case, in this order:

1. the 1-minute load average (``/proc/loadavg``); above ``--max-load`` the bench waits (up to ``--wait`` seconds)
   for it to drop, and records what it was either way;
2. the plan: :func:`pipelines.execution.plan.plan_estimate` in this process (``dmlrc sweep --plan``'s own code path
   and calibration, with the load it sees when it starts);
3. the sweep: ``dmlrc sweep`` in a subprocess, its wall time measured around the process, the load average sampled
   every 5 s meanwhile;
4. from the sweep's MLflow fold runs: each fold's ``train_seconds`` against the calibrated compute of a fold
   (``fold_work``) spread over its threads — the measured stretch — beside the plan's ``max(1, processes × threads
   / cores)`` without :data:`~pipelines.execution.plan.CONTENTION`: their ratio is the contention the plan's
   constant stands for.

Printed: per case the plan's wall time, the measured one, the error, the loads, the measured and modelled stretch.
"""

from __future__ import annotations

import argparse
import copy
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

FOLDS, ITERS_PER_EPOCH, MAX_EPOCHS = 4, 60, 6


def load1() -> float:
    with open("/proc/loadavg", encoding="ascii") as f:
        return float(f.read().split()[0])


def wait_for_quiet(max_load: float, wait_s: float) -> tuple[float, float, float]:
    """(load when the case began, load when it went on, seconds waited)."""
    first = now = load1()
    t0 = time.monotonic()
    while now > max_load and time.monotonic() - t0 < wait_s:
        time.sleep(10)
        now = load1()
    return first, now, time.monotonic() - t0


class LoadSampler(threading.Thread):
    """The 1-minute load average every ``every`` seconds until stopped."""

    def __init__(self, every: float = 5.0):
        super().__init__(daemon=True)
        self.every, self.samples, self._stop_event = every, [], threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.samples.append(load1())
            self._stop_event.wait(self.every)

    def stop(self) -> list[float]:
        self._stop_event.set()
        self.join()
        return self.samples


def sweep_doc(name: str, storage: Path, num_cpus: int) -> dict:
    from pipelines.config.presets import DEMO

    doc = copy.deepcopy(DEMO)
    doc["name"], doc["storage"] = name, str(storage)
    doc["losses"] = [{"name": "contrastive"}]
    doc["protocol"].update(
        folds=FOLDS,
        trials=1,
        startup_trials=1,
        reproductions=2,
        iters_per_epoch=ITERS_PER_EPOCH,
        eval_every=2,
        patience=1000,  # no early stop: the plan's bound at the epoch cap is the real count
        max_epochs=MAX_EPOCHS,
    )
    doc["resources"].update(workers_per_fold=1, cpus_per_worker=1, max_concurrent_trials=1, num_cpus=num_cpus)
    return doc


def fold_runs(db: Path, experiment: str) -> list:
    from mlflow.tracking import MlflowClient

    from pipelines.tracking.runs import search_all

    client = MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name(experiment)
    return [r for r in search_all(client, exp.experiment_id, "") if r.data.tags.get("stage") == "fold"]


def run_case(n: int, workdir: Path, max_load: float, wait_s: float) -> dict:
    import yaml

    from pipelines.config.schema import parse_config
    from pipelines.execution.plan import fold_work, plan_estimate

    name = f"plancheck-{n}"
    doc = sweep_doc(name, workdir / f"runs-{n}", n)
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    cfg = parse_config(doc)

    load_first, load_start, waited = wait_for_quiet(max_load, wait_s)
    res = plan_estimate(cfg)
    est, plan = res.estimate, res.todo[0]
    work, _ = fold_work(plan, res.counts[plan.key], res.timings[plan.key])
    slots = est.slots
    in_flight = slots.rounds(FOLDS)[0]
    modelled = slots.stretch(in_flight) / slots.factor  # the sharing alone, without CONTENTION

    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="dmlrc-ray-")  # short: Ray's socket paths stay < 108 bytes
    dmlrc = Path(sys.executable).parent / "dmlrc"
    load_sweep = load1()
    sampler = LoadSampler()
    sampler.start()
    t0 = time.perf_counter()
    proc = subprocess.run([str(dmlrc), "sweep", str(path)], cwd=workdir, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    samples = sampler.stop()
    if proc.returncode != 0:
        raise SystemExit(f"case {n}: the sweep failed ({proc.returncode}):\n{proc.stderr[-3000:]}")

    folds = fold_runs(Path(doc["storage"]) / name / "mlflow.db", name)
    capped = all(int(r.data.metrics.get("iterations", 0)) == ITERS_PER_EPOCH * MAX_EPOCHS for r in folds)
    per_thread = work / (slots.workers * slots.threads)
    stretches = [r.data.metrics["train_seconds"] / per_thread for r in folds]
    measured = statistics.median(stretches)
    return {
        "folds_in_flight": in_flight,
        "num_cpus": n,
        "usable_cores": slots.cores,
        "fold_runs": len(folds),
        "every_fold_to_the_cap": capped,
        "plan_wall_s": est.wall_s,
        "measured_wall_s": wall,
        "error": est.wall_s / wall - 1,
        "plan_stretch": slots.stretch(in_flight),
        "modelled_sharing": modelled,
        "measured_stretch_median": measured,
        "measured_stretch_range": [min(stretches), max(stretches)],
        "contention_measured": measured / modelled,
        "calibrated_fold_work_s": work,
        "fold_train_seconds_median": statistics.median(r.data.metrics["train_seconds"] for r in folds),
        "load_case_start": load_first,
        "load_waited_s": waited,
        "load_at_plan": load_start,
        "load_at_sweep_start": load_sweep,
        "load_during_sweep_mean": statistics.fmean(samples) if samples else None,
        "load_during_sweep_max": max(samples) if samples else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="1,2,4", help="logical CPUs of the local Ray per case (folds in flight)")
    ap.add_argument("--max-load", type=float, default=0.7)
    ap.add_argument("--wait", type=float, default=300.0, help="longest wait per case for the load to drop (s)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="dmlrc-plancheck-"))
    rows = []
    for n in (int(c) for c in args.cases.split(",")):
        row = run_case(n, workdir, args.max_load, args.wait)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        "\nfolds in flight | plan wall | measured wall | error | stretch: plan / measured (median) | "
        "contention measured | load: case start / plan / sweep mean, max"
    )
    for r in rows:
        print(
            f"{r['folds_in_flight']:15d} | {r['plan_wall_s']:7.1f} s | {r['measured_wall_s']:11.1f} s | "
            f"{100 * r['error']:+4.0f} % | ×{r['plan_stretch']:.2f} / ×{r['measured_stretch_median']:.2f} | "
            f"×{r['contention_measured']:.2f} | {r['load_case_start']:.2f} / {r['load_at_plan']:.2f} / "
            f"{r['load_during_sweep_mean']:.2f}, {r['load_during_sweep_max']:.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
