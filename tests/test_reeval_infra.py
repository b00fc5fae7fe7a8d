"""infra/reeval: the CronJob is a well-formed batch/v1 CronJob that runs exactly the command line
``tests/test_reeval.py`` runs (``dmlrc reeval CONFIG``), on a config that passes ``dmlrc reeval``'s own checks."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]
REEVAL = ROOT / "infra" / "reeval"


def _cronjob() -> dict:
    docs = [d for d in yaml.safe_load_all((REEVAL / "cronjob.yaml").read_text()) if d]
    assert len(docs) == 1
    return docs[0]


def test_cronjob_is_a_valid_batch_v1_cronjob():
    cj = _cronjob()
    assert cj["apiVersion"] == "batch/v1" and cj["kind"] == "CronJob"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", cj["metadata"]["name"]) and len(cj["metadata"]["name"]) <= 52
    spec = cj["spec"]
    fields = spec["schedule"].split()
    assert len(fields) == 5 and all(re.fullmatch(r"[\d*/,-]+", f) for f in fields)
    assert spec["concurrencyPolicy"] in ("Allow", "Forbid", "Replace")
    job = spec["jobTemplate"]["spec"]
    pod = job["template"]["spec"]
    # podFailurePolicy is only allowed with restartPolicy Never, and must name an existing container
    assert pod["restartPolicy"] == "Never"
    names = {c["name"] for c in pod["containers"]}
    for rule in job["podFailurePolicy"]["rules"]:
        assert rule["action"] in ("FailJob", "Ignore", "Count", "FailIndex")
        assert rule["onExitCodes"]["containerName"] in names
    # a regression (3) and a bad config (2) fail the Job without retries; a failure (1) is retried
    codes = {
        c for r in job["podFailurePolicy"]["rules"] if r["action"] == "FailJob" for c in r["onExitCodes"]["values"]
    }
    assert codes == {2, 3}
    # every mounted volume exists; no credential literal in the manifest
    vols = {v["name"] for v in pod["volumes"]}
    for c in pod["containers"]:
        assert {m["name"] for m in c.get("volumeMounts", [])} <= vols
        for e in c.get("env", []):
            if "SECRET" in e["name"] or "KEY" in e["name"]:
                assert "valueFrom" in e and "value" not in e, e


def test_cronjob_runs_the_command_line_the_tests_run_on_a_valid_config():
    from pipelines.commands import build_parser
    from pipelines.reeval.run import load_reeval_config

    pod = _cronjob()["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    argv = container["command"] + container.get("args", [])
    # `dmlrc` is the console script of pipelines.cli:main, which tests/test_reeval.py runs as
    # `python -m pipelines.cli reeval CONFIG`
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert argv[0] == "dmlrc" and scripts["dmlrc"] == "pipelines.cli:main"
    assert argv[1] == "reeval" and len(argv) == 3
    args = build_parser().parse_args(argv[1:])
    assert args.command == "reeval" and args.config == argv[2]
    # the config file the ConfigMap mounts at that path is infra/reeval/<same name>, and it parses
    mount = next(m for m in container["volumeMounts"] if argv[2].startswith(m["mountPath"].rstrip("/") + "/"))
    cfg_file = REEVAL / Path(argv[2]).relative_to(mount["mountPath"])
    assert cfg_file.is_file()
    cfg = load_reeval_config(cfg_file)
    assert cfg.models and cfg.datasets and cfg.ray_address
    # the re-sweep it replaces is kept, renamed, with a different name and schedule
    resweep = yaml.safe_load((REEVAL / "resweep-cronjob.yaml").read_text())
    assert resweep["metadata"]["name"] != _cronjob()["metadata"]["name"]


def test_every_reeval_config_in_infra_reeval_parses():
    """Every ``dmlrc reeval`` config shipped in infra/reeval (a YAML mapping with ``models``; not the Kubernetes
    manifests or the re-sweep's sweep config) passes the loader and names a tracking server and a Ray cluster."""
    from pipelines.reeval.config import load_reeval_config

    found = []
    for path in sorted(REEVAL.glob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        if len(docs) == 1 and isinstance(docs[0], dict) and "models" in docs[0] and "apiVersion" not in docs[0]:
            cfg = load_reeval_config(path)
            assert cfg.models and cfg.datasets and cfg.tracking_uri.startswith("http") and cfg.ray_address, path
            found.append(path.name)
    assert "reeval.yaml" in found


def test_the_systemd_unit_runs_the_same_subcommand():
    unit = (REEVAL / "dmlrc-reeval.service").read_text()
    exec_line = next(l for l in unit.splitlines() if l.startswith("ExecStart="))
    assert exec_line.split()[1:] == ["reeval", "reeval.yaml"] and exec_line.split()[0].endswith("/dmlrc")
    assert "OnCalendar=" in (REEVAL / "dmlrc-reeval.timer").read_text()
