"""The fault-free reference for docs/reliability.md: the sweep of ``tests/test_faults.py`` (same config, same cluster
shape: a head with no CPUs, two worker nodes of 2 CPUs, SeaweedFS, MLflow on PostgreSQL) run once with no fault.
Prints its wall time and the counts ``tests/test_faults.py`` records for each fault, after the same checks.

    python bench/faults_reference_bench.py          # needs PostgreSQL on 127.0.0.1:5432 and the dev extra (weed)
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> None:
    from test_faults import _check_tree, _config

    from tests.cluster import local_cluster

    with tempfile.TemporaryDirectory(prefix="faults-ref-") as tmp, local_cluster(tmp, workers=2, worker_cpus=2) as c:
        work = Path(tmp)
        cfg = _config(work, c.tracking_uri, c.storage("reference"), name="reference", trials=1, reproductions=2)
        t0 = time.time()
        out = subprocess.run(
            [sys.executable, "-m", "pipelines.cli", "sweep", str(cfg), "--address", c.address],
            cwd=work,
            capture_output=True,
            text=True,
            env=c.driver_env(),
        )
        wall = time.time() - t0
        if out.returncode != 0:
            raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
        counts = _check_tree(c, "reference-experiment", parents=3)
        print(f"fault-free reference: wall {wall:.1f} s; {counts}")


if __name__ == "__main__":
    main()
