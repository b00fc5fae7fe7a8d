"""Fuzz corpus of malformed sweep configs, run through the real CLI entry (``pipelines.cli.main(["sweep", ...])``).

Every case of ``tests/config_fuzz/corpus.yaml`` must end in lines ``config error: <field>: <problem>`` (one per
problem), the first naming the case's field, exit status 2, within a bounded time, with nothing written (no
``runs/<name>/``, no MLflow store) and no password echoed.  Ray start-up and MLflow are stubbed: reaching either means
the bad config passed validation, which is a failure too.

``python tests/test_config_fuzz.py`` runs the corpus outside pytest and prints how many cases end in each way
(what the README's "What bad input gets" reports; run it with an older checkout on PYTHONPATH to compare).
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).resolve().parent
CORPUS = yaml.safe_load((HERE / "config_fuzz" / "corpus.yaml").read_text())["cases"]
SECRET = "s3cr3t"
CASE_SECONDS = 60
#: Environment variables a case must not inherit from the machine running the tests.
_CLEAN_ENV = (
    "MLFLOW_TRACKING_URI",
    "RAY_ADDRESS",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
)


class Hang(BaseException):
    """The script's alarm: a BaseException, so that no ``except OSError`` in the code under test swallows it."""


class Launched(Exception):
    """Raised by the stubs of Ray start-up and MLflow: the config got past validation."""


@dataclass
class Outcome:
    case: str
    #: ok | traceback | hang | passed validation | wrong field | not one line | wrote files | leaked password
    verdict: str
    detail: str
    seconds: float


def _set(doc: dict, dotted: str, value) -> None:
    node = doc
    keys = dotted.split(".")
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node.setdefault(k, {})
    if isinstance(node, list):
        node[int(keys[-1])] = value
    else:
        node[keys[-1]] = value


def _delete(doc: dict, dotted: str) -> None:
    node = doc
    keys = dotted.split(".")
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    del node[int(keys[-1]) if isinstance(node, list) else keys[-1]]


def _subst(value, tmp: Path):
    if isinstance(value, str):
        return value.replace("{tmp}", str(tmp))
    if isinstance(value, list):
        return [_subst(v, tmp) for v in value]
    if isinstance(value, dict):
        return {k: _subst(v, tmp) for k, v in value.items()}
    return value


def _write_fixture(path: Path, spec) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(spec, str):
        path.write_text(spec)
    elif spec.get("dir"):
        path.mkdir(exist_ok=True)
    elif "symlink" in spec:  # {symlink: target}: target relative to the link's folder (loops allowed)
        path.symlink_to(spec["symlink"])
    elif "hex" in spec:
        path.write_bytes(bytes.fromhex(spec["hex"]))
    elif "torch" in spec:
        import torch

        kind = spec["torch"]
        if kind == "garbage":
            path.write_bytes(b"\x80\x02not a torch file" * 10)
        elif kind == "list":
            torch.save([torch.zeros(2), torch.ones(3)], path)
        elif kind == "other_state_dict":
            torch.save({"some.layer.weight": torch.zeros(2, 2)}, path)
        else:
            raise ValueError(kind)
    else:
        raise ValueError(spec)


def build_case(case: dict, tmp: Path) -> Path:
    """Write the case's config (and fixtures) under ``tmp``; returns the path handed to ``dmlrc sweep``."""
    from pipelines.config.presets import DEMO

    for rel, spec in (case.get("files") or {}).items():
        _write_fixture(tmp / rel, spec)
    if case.get("config_missing"):
        return tmp / "missing.yaml"
    if case.get("config_is_dir"):
        (tmp / "confdir").mkdir()
        return tmp / "confdir"
    path = tmp / "config.yaml"
    if "raw" in case:
        path.write_text(case["raw"])
    elif "raw_hex" in case:
        path.write_bytes(bytes.fromhex(case["raw_hex"]))
    elif "raw_repeat" in case:
        a, n, b = case["raw_repeat"]
        path.write_text(a * n + b * n)
    else:
        doc = copy.deepcopy(DEMO)
        doc["storage"] = "runs"
        for dotted in case.get("delete") or ():
            _delete(doc, dotted)
        for dotted, value in (case.get("set") or {}).items():
            _set(doc, dotted, _subst(value, tmp))
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _stub_launch(patch) -> None:
    """Ray start-up and MLflow raise :class:`Launched` (``patch(obj, name, value)`` sets an attribute)."""
    from pipelines.execution.runtime import session as ray_session
    from pipelines.tracking.runs import Tracker

    def launched(*args, **kwargs):
        raise Launched("validation passed: Ray / MLflow would start now")

    patch(ray_session, "start_ray", launched)

    patch(Tracker, "open", classmethod(lambda cls, *a, **k: launched()))
    if "ray" in sys.modules:
        patch(sys.modules["ray"], "init", launched)
    import torch

    patch(torch.cuda, "is_available", lambda: False)  # the corpus assumes a machine without GPUs
    patch(torch.cuda, "device_count", lambda: 0)


def run_case(case: dict, tmp: Path, patch, setenv, delenv) -> Outcome:
    """Run one case through ``pipelines.cli.main``; the caller chdirs into ``tmp`` and undoes the patches."""
    from pipelines.cli import main

    for k in _CLEAN_ENV:
        delenv(k)
    for k, v in (case.get("env") or {}).items():
        setenv(k, v) if v else delenv(k)
    _stub_launch(patch)
    path = build_case(case, tmp)
    before = _tree(tmp)
    expected = str(path) if case["field"] == "<file>" else case["field"]
    err, out = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                rc = main(["sweep", str(path), *case.get("args", ())])
            except SystemExit as e:  # argparse
                rc = e.code
    except Launched:
        return Outcome(case["id"], "passed validation", "", time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - a traceback is what the corpus counts
        return Outcome(case["id"], "traceback", f"{type(e).__name__}: {str(e)[:200]}", time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    text = err.getvalue().strip()
    lines = text.splitlines()
    if SECRET in text + out.getvalue():
        return Outcome(case["id"], "leaked password", text, seconds)
    # one line per problem, each "config error: ..." (several problems of one document are each reported)
    if rc != 2 or not lines or not all(line.startswith("config error: ") for line in lines):
        return Outcome(case["id"], "not one line", f"rc={rc}: {text[:300]}", seconds)
    if not lines[0].startswith(f"config error: {expected}: "):
        return Outcome(case["id"], "wrong field", f"expected {expected!r}: {lines[0][:300]}", seconds)
    written = sorted(_tree(tmp) - before)
    if written:
        return Outcome(case["id"], "wrote files", ", ".join(written[:5]), seconds)
    return Outcome(case["id"], "ok", lines[0], seconds)


# ---------------------------------------------------------------------------------------------------------- tests


def test_the_corpus_is_large_and_its_ids_are_unique():
    ids = [c["id"] for c in CORPUS]
    assert len(ids) >= 100 and len(set(ids)) == len(ids)


def _schema_fields() -> set[str]:
    """Every leaf field of the sweep schema, as ``protocol.train.m`` / ``datasets[].kind``."""
    from pydantic import BaseModel

    from pipelines.config import schema as config

    out: set[str] = set()

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name in model.model_fields:
            path = f"{prefix}{name}"
            sub = {
                "model": config.ModelSpec,
                "protocol": config.ProtocolSpec,
                "resources": config.ResourcesSpec,
                "tracking": config.TrackingSpec,
                "train": config.TrainSpec,
                "runtime_env": config.RuntimeEnvSpec,
            }.get(name)
            if sub is not None and name in getattr(model, "model_fields", {}):
                out.add(path)
                walk(sub, path + ".")
            else:
                out.add(path)

    walk(config.SweepConfig, "")
    for m in (
        config.SyntheticDataset,
        config.OmniglotDataset,
        config.FolderDataset,
        config.ParquetDataset,
        config.CsvDataset,
    ):
        walk(m, "datasets[].")
    walk(config.LossSpec, "losses[].")
    return out


def test_the_corpus_covers_every_field_of_the_schema():
    covered = {re.sub(r"\[\d+\]", "[]", c["field"]).split(".params.")[0] for c in CORPUS}
    missing = sorted(_schema_fields() - covered)
    assert not missing, f"fields without a malformed case: {missing}"


@pytest.mark.timeout(CASE_SECONDS)
@pytest.mark.parametrize("case", CORPUS, ids=[c["id"] for c in CORPUS])
def test_malformed_config_is_one_line_naming_its_field(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    outcome = run_case(
        case, tmp_path, monkeypatch.setattr, monkeypatch.setenv, lambda k: monkeypatch.delenv(k, raising=False)
    )
    assert outcome.verdict == "ok", f"{outcome.verdict}: {outcome.detail}"
    assert outcome.seconds < CASE_SECONDS


# ---------------------------------------------------------------------------------------------------------- script


def _main() -> int:
    """Run the corpus outside pytest; print one line per case that is not ok and the counts per verdict."""
    import tempfile
    from collections import Counter

    counts: Counter[str] = Counter()

    def on_alarm(signum, frame):
        raise Hang(f"no answer within {CASE_SECONDS} s")

    signal.signal(signal.SIGALRM, on_alarm)
    for case in CORPUS:
        undo: list = []

        def patch(obj, name, value):
            undo.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)

        saved_env = dict(os.environ)
        cwd = os.getcwd()
        with tempfile.TemporaryDirectory() as tmp:
            os.chdir(tmp)
            signal.alarm(CASE_SECONDS)
            try:
                o = run_case(case, Path(tmp), patch, os.environ.__setitem__, lambda k: os.environ.pop(k, None))
            except Hang as e:
                o = Outcome(case["id"], "hang", str(e), CASE_SECONDS)
            finally:
                signal.alarm(0)
                os.chdir(cwd)
                for obj, name, value in reversed(undo):
                    setattr(obj, name, value)
                os.environ.clear()
                os.environ.update(saved_env)
        counts[o.verdict] += 1
        if o.verdict != "ok":
            print(f"{o.verdict:18s} {o.case}: {o.detail[:160]}", flush=True)
    print(f"{len(CORPUS)} cases: " + ", ".join(f"{v} {n}" for v, n in counts.most_common()))
    return 0 if counts["ok"] == len(CORPUS) else 1


if __name__ == "__main__":
    sys.exit(_main())
