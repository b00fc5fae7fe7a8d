"""Each study's Tuners keep their own state, also when two studies start in the same second.

Tune stages an experiment's state on the driver under ``<Ray session>/artifacts/<start second>/<experiment name>``
and copies that folder to the experiment's storage; a restored experiment stages under its first start's second
again.  With one name for every study's search, two studies started together shared it: each study's storage
received the other's trials and searcher state, and ``--resume`` restored one study's search with another's history
or stopped on Optuna's ``KeyError`` for a trial its searcher never saw (seen on a 2-node cluster, where a sweep runs
two studies at once).  The test runs two Tuners at once in one driver with Tune's clock stopped (every start in the
same second), as real starts within one second are, then restores both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.names import tuner_name

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = """
import json, sys, threading
import ray
from ray import tune
import ray.tune.utils
from pipelines.execution.runtime.environment import WORKER_SETUP_HOOK
from pipelines.execution.studies.tuners import fit_tuner
from pipelines.names import tuner_name

ray.tune.utils.date_str = lambda: "2026-01-01_00-00-00"  # every Tuner starts in the same second
storage = sys.argv[1]
# the worker hook a sweep's Ray has: a worker stopped by ray.shutdown() while in a finalizer exits quietly
ray.init(
    num_cpus=2,
    include_dashboard=False,
    logging_level="ERROR",
    runtime_env={"worker_process_setup_hook": WORKER_SETUP_HOOK},
)

def train(config):
    tune.report({"objective": float(config["x"])})

studies = {"a": [1, 2], "b": [10, 20]}
for study in studies:
    tune.register_trainable(f"train_{study}", train)
rows = {}

def run(study):
    def new():
        return {"x": tune.grid_search(studies[study])}, tune.TuneConfig(), []
    got = fit_tuner(f"{storage}/{study}", "search", f"train_{study}", new, sweep="s", trial_retries=0, say=print)
    rows[study] = sorted(int(r["config"]["x"]) for r in got)

for attempt in ("first", "restored"):
    threads = [threading.Thread(target=run, args=(s,)) for s in studies]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print(json.dumps({attempt: rows}), flush=True)

# A study's Tuner stored under the name every study had before (``<study>/search``) is restored from there.
tune.register_trainable("train_c", train)
legacy = tune.RunConfig(name="search", storage_path=f"{storage}/c", verbose=0)
tune.Tuner("train_c", param_space={"x": tune.grid_search([5])}, run_config=legacy).fit()
got = fit_tuner(f"{storage}/c", "search", "train_c", None, sweep="s", trial_retries=0, say=print)
print(json.dumps({"legacy": [int(r["config"]["x"]) for r in got]}), flush=True)

# A Tuner built but stopped before Tune's first snapshot (only its tuner.pkl) starts anew, without Tune's
# "Failed to restore the run state" traceback.
tune.register_trainable("train_d", train)
early = tune.RunConfig(name=tuner_name("s", f"{storage}/d", "search"), storage_path=f"{storage}/d", verbose=0)
tune.Tuner("train_d", param_space={"x": tune.grid_search([7])}, run_config=early)  # writes tuner.pkl only

def new_d():
    return {"x": tune.grid_search([7])}, tune.TuneConfig(), []

got = fit_tuner(f"{storage}/d", "search", "train_d", new_d, sweep="s", trial_retries=0, say=print)
print(json.dumps({"early": [int(r["config"]["x"]) for r in got]}), flush=True)
ray.shutdown()
"""


@pytest.mark.slow  # a local Ray and two Tuners: not for `make test-fast`
def test_two_studies_started_in_one_second_keep_their_own_tune_state(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "TUNE_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert out == [
        {"first": {"a": [1, 2], "b": [10, 20]}},
        {"restored": {"a": [1, 2], "b": [10, 20]}},
        {"legacy": [5]},
        {"early": [7]},
    ]
    assert "Failed to restore" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert "resuming search from " + str(tmp_path / "d") not in proc.stdout
    assert f"resuming search from {tmp_path / 'a' / tuner_name('s', str(tmp_path / 'a'), 'search')}" in proc.stdout
    assert f"resuming search from {tmp_path / 'c' / 'search'}" in proc.stdout
    for study, other in (("a", "b"), ("b", "a")):
        folder = tmp_path / study / tuner_name("s", str(tmp_path / study), "search")
        trials = [p.name for p in folder.iterdir() if p.is_dir()]
        assert len(trials) == 2 and all(name.startswith(f"train_{study}_") for name in trials), (study, trials)
