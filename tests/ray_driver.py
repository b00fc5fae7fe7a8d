"""A Ray driver script run as a ``dmlrc`` command's driver process would be: its own Python, its own HOME, this
checkout first on the path, and no Ray or AWS settings inherited from the test's environment.

    out = run_driver(SCRIPT, tmp_path, "an argument")  # SCRIPT calls init_ray ... stop_ray; out.stdout/.stderr
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["run_driver"]

ROOT = Path(__file__).resolve().parents[1]


def run_driver(script: str, home: Path, *args: str) -> subprocess.CompletedProcess:
    """Run ``script`` (``python -c``) in ``home`` with ``args``; its output captured as text."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_"))}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0")
    return subprocess.run(
        [sys.executable, "-c", script, *args], cwd=home, env=env, capture_output=True, text=True, timeout=300
    )
