"""Ray reads some of the sweep's settings (``runtime/environment.py``'s ``RAY_ENV``) when it is imported, so the module
that imports Ray for a command sets them first, and the sweep's checks load no Ray at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import json, sys
import pipelines.execution.sweep  # what dmlrc sweep loads for its checks
before = "ray" in sys.modules
import pipelines.execution.runtime.session  # what the sweep imports once the checks passed
from ray._private import ray_constants
print(json.dumps({"ray_before": before, "dedup": ray_constants.RAY_DEDUP_LOGS}))
"""


def _run_probe(code: str) -> dict:
    """Run ``code`` in a fresh interpreter without the machine's Ray or Tune settings; its last line, as JSON."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "TUNE_"))}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_ray_is_imported_after_its_settings_and_not_by_the_checks():
    out = _run_probe(_PROBE)
    assert out["ray_before"] is False, "the sweep's checks imported Ray"
    assert out["dedup"] is False, "Ray was imported before RAY_ENV (RAY_DEDUP_LOGS=0) was set"


_REEVAL_PROBE = """
import json
import pipelines.reeval.run  # what dmlrc reeval loads
from ray._private import ray_constants
print(json.dumps({"dedup": ray_constants.RAY_DEDUP_LOGS}))
"""


def test_reeval_imports_ray_after_its_settings():
    out = _run_probe(_REEVAL_PROBE)
    assert out["dedup"] is False, "dmlrc reeval imported Ray before RAY_ENV (RAY_DEDUP_LOGS=0) was set"
