"""``dmlrc reeval`` joins the Ray cluster its config's ``ray_address`` names: when no cluster answers there, the
one-line error names ``ray_address`` (the setting the user wrote), not the sweep's ``--address`` flag."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[1]

_START = textwrap.dedent(
    """
    import sys
    import types

    from pipelines.config import ConfigError
    from pipelines.execution.runtime.session import stop_ray
    from pipelines.reeval.embed import start_ray

    try:
        stop_ray(start_ray(types.SimpleNamespace(ray_address=sys.argv[1])))
    except ConfigError as e:
        stop_ray(False)
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    """
)


def test_no_cluster_at_ray_address_names_the_config_field(tmp_path):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_"))}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(HOME=str(tmp_path), RAY_USAGE_STATS_ENABLED="0")
    out = subprocess.run(
        [sys.executable, "-c", _START, address],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"config error: ray_address: no Ray cluster answers at {address} ("), out.stderr
    assert "--address" not in out.stderr and "Traceback" not in out.stderr, out.stderr
