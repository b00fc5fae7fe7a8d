"""What type-checking pipelines/ (mypy, `make lint`) found that could fail at run time, each pinned here."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from pipelines.config.spaces import Param
from pipelines.results.study_results import fmt_ci
from pipelines.tracking.outage import TrackingWatch


def test_docs_and_presets_import_without_importlib_resources_abc():
    # importlib.resources.abc is Python 3.11+; the project supports 3.10 (requires-python), where only importlib.abc
    # has Traversable.  A subprocess where the module does not exist, as on 3.10: `dmlrc docs` and the presets load.
    code = textwrap.dedent(
        """
        import importlib.abc, importlib.resources, sys  # loaded first: on 3.11 they import .abc themselves
        sys.modules["importlib.resources.abc"] = None  # 3.10: no such module
        from pipelines.config.presets import presets
        from pipelines.docs_cli import user_docs
        assert "demo" in presets() and user_docs()
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_tracking_watch_with_nothing_to_probe_answers():
    # sqlite: no server to watch (no thread starts); a direct probe said TypeError (unpacking its None target)
    watch = TrackingWatch("sqlite:///mlflow.db", outage_timeout_s=60)
    assert watch.target is None and watch.probe() is True


def test_fmt_ci_of_an_unmeasured_metric():
    # the end-of-study line formats summary.ci[mode].get("map_at_r"), None where no reproduction measured it
    assert fmt_ci(None) == "–"
    assert fmt_ci((0.5, 0.4, 0.6)) == "50.00 ± 10.00 [40.00, 60.00]"


def test_param_bounds_and_options_name_a_malformed_parameter():
    assert Param("margin", 0.0, 1.0).bounds == (0.0, 1.0)
    assert Param("pooling", type="categorical", choices=("avg", "max")).options == ("avg", "max")
    with pytest.raises(ValueError, match="'margin': a float range needs low and high"):
        Param("margin").midpoint()
    with pytest.raises(ValueError, match="'pooling': a categorical parameter needs choices"):
        Param("pooling", type="categorical").describe()
