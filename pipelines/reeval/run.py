"""``dmlrc reeval CONFIG``: re-evaluate registered reality-check models on the current test data, with the current code.

Config (YAML): :mod:`pipelines.reeval.config` — its keys (``models``, ``datasets``, ``metrics``, ``tolerance``, ...),
the pydantic schema, the hardened loader and the published JSON Schema ``docs/reeval-config.schema.json``;
:func:`load_reeval_config` and :class:`ReevalConfig` are re-exported here.

Per model version (:func:`evaluate_version`): the test classes come from the study's fold manifest
(``folds.json``); Ray Data (:mod:`pipelines.reeval.embed`) streams the dataset's parquet shards through actors that
hold every reproduction's pyfunc model and returns only the embeddings to the driver; the metrics are the sweep's own
test step (``retrieval_metrics`` per fold model → ``pipelines.results.embeddings.reproduction_test_metrics``,
separated and concatenated), the intervals ``pipelines.results.study_results.confidence_intervals`` (95 % Student-t
across reproductions, docs/protocol.md §Test evaluation).

Regression rule (per compared metric, concatenated and separated).  The re-evaluated models are the registered
models themselves, so reproduction ``i`` now and at registration share the seed: the comparison is **paired**.
With ``d_i = now_i − registered_i``: **regressed** when the mean drop ``−mean(d)`` exceeds ``tolerance`` *and*
the drop is not explained by reproduction-to-reproduction noise — the 95 % t-interval of ``mean(d)`` lies below
zero (with < 2 pairs, or identical differences, the tolerance alone decides).  Without per-reproduction values
(unpaired) it is regressed when the drop exceeds the tolerance and the new interval's upper bound is below the
registered lower bound.  Why paired: the seeds pair, so the between-seed variance cancels and a small real drop on
changed data is not hidden by training noise; the tolerance keeps a statistically clear but irrelevant drop quiet.

Exit status: 0 every version ok, 3 any regressed, 1 any failed (a missing/corrupt artifact fails that version
only; the others are still evaluated), 2 bad config (one ``config error: <field>: ...`` line before Ray starts).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import html
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
from mlflow.entities import LoggedModelInput, Metric
from mlflow.tracking import MlflowClient

from dml_core.evaluation.metrics import retrieval_metrics
from dml_core.evaluation.stats import confidence_interval
from dml_core.shards import read_manifest
from dml_core.splits import FoldManifest
from pipelines.config.schema import ConfigError
from pipelines.execution.runtime.environment import check_tracking_reachable
from pipelines.execution.runtime.session import stop_ray
from pipelines.names import ALIAS, MODES, REPRODUCTION
from pipelines.reeval.config import ReevalConfig, Target, load_reeval_config
from pipelines.reeval.embed import embed_version, start_ray
from pipelines.results.embeddings import reproduction_test_metrics, split_folds
from pipelines.results.plotting import plt
from pipelines.results.study_results import confidence_intervals
from pipelines.tracking.datasets import log_dataset_input
from pipelines.tracking.evaluations import finite_metrics
from pipelines.tracking.model_registry import as_registered_name, fluent_tracking
from pipelines.tracking.runs import git_commit

__all__ = [
    "ReevalConfig",
    "load_reeval_config",
    "run_reeval",
    "regression_verdict",
    "manifest_digest",
]

# ------------------------------------------------------------------------------------------------ resolution


def manifest_digest(manifest: dict) -> str:
    """sha256 of the canonical JSON of a parquet manifest (the digest ``pipelines.tracking.model_registry``
    registers)."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def resolve_versions(cfg: ReevalConfig) -> list[Target]:
    """Every version the config names, checked against MLflow and the datasets; ConfigError before Ray starts."""
    if cfg.tracking_uri.startswith(("http://", "https://")):
        check_tracking_reachable(cfg.tracking_uri)
    client = MlflowClient(cfg.tracking_uri)
    found: list[tuple[str, Any]] = []
    for i, m in enumerate(cfg.models):
        where = f"models[{i}]"
        # the loss spelt as in the sweep config (sec:triplet) names the model registered as sec-triplet
        name = as_registered_name(m["name"]) if "name" in m else None
        try:
            if name is not None:
                if "version" in m:
                    found.append((where, client.get_model_version(name, str(m["version"]))))
                else:
                    found.append((where, client.get_model_version_by_alias(name, m.get("alias", ALIAS))))
            else:
                models = client.search_registered_models(f"tags.experiment = '{m['experiment']}'")
                if not models:
                    raise ConfigError(f"{where}.experiment", f"no registered model of experiment {m['experiment']!r}")
                for rm in models:
                    if ALIAS in (rm.aliases or {}):
                        found.append((where, client.get_model_version_by_alias(rm.name, ALIAS)))
        except ConfigError:
            raise
        except Exception as e:  # MLflow's "not found" errors differ between stores
            what = (
                f"{m.get('name')}{f' (registered as {name})' if name != m.get('name') else ''} "
                f"{'version ' + str(m['version']) if 'version' in m else 'alias ' + m.get('alias', ALIAS)}"
            )
            raise ConfigError(
                f"{where}.name", f"no registered model version {what} ({str(e).splitlines()[0][:200]})"
            ) from None
    # One version named twice (by `name` and through its `experiment`, or twice by name) is evaluated once: the
    # first entry that names it is the one its errors point at.
    unique: dict[tuple[str, str], tuple[str, Any]] = {}
    for where, mv in found:
        unique.setdefault((mv.name, str(mv.version)), (where, mv))
    targets, manifests = [], {}
    for where, mv in unique.values():
        tags = dict(mv.tags)
        ds = tags.get("dataset")
        if ds not in cfg.datasets:
            raise ConfigError(
                "datasets", f"{mv.name} version {mv.version} was trained on dataset {ds!r}; add `{ds}: <parquet URI>`"
            )
        uri = cfg.datasets[ds]
        if uri not in manifests:
            try:
                manifests[uri] = read_manifest(uri)
            except Exception as e:  # missing file, bad JSON, unreachable S3: all the user's to fix
                raise ConfigError(f"datasets.{ds}", f"{str(e).splitlines()[0][:300]}") from None
        manifest = manifests[uri]
        try:
            folds = FoldManifest.from_json(
                Path(client.download_artifacts(tags["study_run_id"], "folds.json")).read_text()
            )
            reps = json.loads(tags["reproductions"])
        except Exception as e:  # a version without what we registered is not re-evaluable
            raise ConfigError(
                where,
                f"{mv.name} version {mv.version} lacks its study's folds.json / "
                f"reproductions tag ({str(e).splitlines()[0][:200]})",
            ) from None
        have = {int(c["label"]) for c in manifest["classes"]}
        missing = sorted(set(int(c) for c in folds.test_classes) - have)
        if missing:
            raise ConfigError(f"datasets.{ds}", f"lacks test classes {missing[:10]} of {mv.name} version {mv.version}")
        targets.append(
            Target(mv.name, str(mv.version), tags, uri, manifest, [int(c) for c in folds.test_classes], reps)
        )
    return targets


# ------------------------------------------------------------------------------------------------ metrics


def reproduction_metrics(folds_output: np.ndarray, labels: np.ndarray, n_folds: int) -> dict[str, float]:
    """The sweep's test step on one reproduction's embeddings: separated + concatenated
    (``pipelines.execution.folds.trial``)."""
    parts = split_folds(folds_output, n_folds)
    # fold_worker's "separated" call, per fold model: retrieval_metrics(test_emb, test_labels)
    outcomes = [{"test_metrics": finite_metrics(retrieval_metrics(p, labels))} for p in parts]
    metrics, _ = reproduction_test_metrics(outcomes, parts, [labels] * n_folds)  # (metrics, the concat search)
    return metrics


def regression_verdict(
    registered: list[float],
    now: list[float],
    *,
    tolerance: float,
    registered_ci: tuple[float, float] | None = None,
    now_ci: tuple[float, float] | None = None,
    paired: bool = True,
) -> tuple[bool, str]:
    """``(regressed, why)`` for one metric — the rule in this module's docstring."""
    drop = float(np.mean(registered) - np.mean(now))
    if drop <= tolerance:
        return False, f"drop {drop:+.4f} ≤ tolerance {tolerance}"
    if paired and len(registered) == len(now):
        d = np.asarray(now, float) - np.asarray(registered, float)
        m, lo, hi = confidence_interval(d)
        if len(d) < 2 or not math.isfinite(hi):
            return True, f"drop {drop:.4f} > tolerance {tolerance} (1 pair: tolerance alone)"
        if hi < 0:
            return (
                True,
                f"drop {drop:.4f} > tolerance {tolerance}; paired 95 % CI of the change [{lo:.4f}, {hi:.4f}] < 0",
            )
        return False, f"drop {drop:.4f} within the paired 95 % CI of the change [{lo:.4f}, {hi:.4f}]"
    if (
        registered_ci
        and now_ci
        and math.isfinite(now_ci[1])
        and math.isfinite(registered_ci[0])
        and now_ci[1] >= registered_ci[0]
    ):
        return False, f"drop {drop:.4f}: intervals overlap"
    return True, f"drop {drop:.4f} > tolerance {tolerance}, intervals apart"


@dataclass
class VersionResult:
    target: Target
    status: str  # ok | regressed | failed
    message: str = ""
    ci: dict = field(default_factory=dict)
    verdicts: dict = field(default_factory=dict)
    seconds: float = 0.0
    embed_seconds: float = 0.0
    images: int = 0
    run_id: str | None = None


def evaluate_version(t: Target, cfg: ReevalConfig) -> VersionResult:
    """Re-evaluate one version; MLflow's fluent API (``models:/`` URIs) points at ``cfg.tracking_uri`` meanwhile
    and is restored afterwards (the process may go on with another store)."""
    with fluent_tracking(cfg.tracking_uri):
        return _evaluate_version(t, cfg)


def _evaluate_version(t: Target, cfg: ReevalConfig) -> VersionResult:
    t0 = time.time()
    # A missing or corrupt artifact fails here, on the driver, with the version named (not deep inside Ray).
    spec: dict[str, Any] = {}  # embedder.json of the last model loaded (read below only when there are reproductions)
    for r in t.reproductions:
        try:
            spec = mlflow.pyfunc.load_model(r["model_uri"]).unwrap_python_model().spec
        except Exception as e:
            return VersionResult(
                t,
                "failed",
                f"{t.label}: reproduction {r['reproduction']} model {r['model_uri']} "
                f"cannot be loaded: {type(e).__name__}: {str(e).splitlines()[0][:300]}",
                seconds=time.time() - t0,
            )
    outputs, labels, embed_s = embed_version(t, cfg)
    rows = []
    for r, out in zip(t.reproductions, outputs):
        m = reproduction_metrics(out, labels, int(spec["folds"]))
        rows.append(
            {REPRODUCTION: r["reproduction"], "seed": r["seed"], **{k.replace(".", "_"): v for k, v in m.items()}}
        )
    ci = confidence_intervals(rows)
    verdicts, regressed = {}, False
    for mode in MODES:
        for metric in cfg.metrics:
            key = f"test.{mode}.{metric}"
            old_or_none = [r["metrics"].get(key) for r in t.reproductions]
            new_or_none = [row.get(key.replace(".", "_")) for row in rows]
            old = [v for v in old_or_none if v is not None]
            new = [v for v in new_or_none if v is not None]
            if len(old) < len(old_or_none) or len(new) < len(new_or_none):
                continue
            reg_ci = (float(t.tags.get(f"{key}.ci_low", "nan")), float(t.tags.get(f"{key}.ci_high", "nan")))
            bad, why = regression_verdict(
                old,
                new,
                tolerance=cfg.tolerance,
                registered_ci=reg_ci,
                now_ci=ci[mode][metric][1:],
                paired=[r["seed"] for r in t.reproductions] == [row["seed"] for row in rows],
            )
            verdicts[key] = {
                "registered": float(np.mean(old)),
                "now": float(np.mean(new)),
                "regressed": bad,
                "why": why,
                "registered_values": old,
                "now_values": new,
            }
            regressed |= bad
    return VersionResult(
        t,
        "regressed" if regressed else "ok",
        ci=ci,
        verdicts=verdicts,
        seconds=time.time() - t0,
        embed_seconds=embed_s,
        images=len(labels),
        message="; ".join(f"{k}: {v['why']}" for k, v in verdicts.items() if v["regressed"]),
    )


# ------------------------------------------------------------------------------------------------ output


def results_table(results: list[VersionResult], metrics) -> tuple[list[str], list[list[str]]]:
    head = ["model", "version", "dataset digest", "status"] + [f"{mode} {m}" for mode in MODES for m in metrics]
    rows = []
    for r in results:
        row = [r.target.name, r.target.version, manifest_digest(r.target.manifest)[:12], r.status]
        for mode in MODES:
            for m in metrics:
                v = r.verdicts.get(f"test.{mode}.{m}")
                row.append("–" if v is None else f"{100 * v['registered']:.2f} → {100 * v['now']:.2f}")
        rows.append(row)
    return head, rows


def write_outputs(results: list[VersionResult], cfg: ReevalConfig) -> dict[str, Path]:
    """``reeval.md``, ``reeval.html``, ``reeval.png`` (values ×100: registered → now)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    head, rows = results_table(results, cfg.metrics)
    md = [
        "# dmlrc reeval: " + cfg.schedule,
        "",
        f"tolerance {cfg.tolerance}; values ×100, registered → now (mean over reproductions)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    md += [""] + [f"- {r.target.label}: **{r.status}** {r.message}" for r in results if r.message]
    paths = {"md": out / "reeval.md", "html": out / "reeval.html", "png": out / "reeval.png"}
    paths["md"].write_text("\n".join(md) + "\n")
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    paths["html"].write_text(
        f"<html><body><h1>dmlrc reeval: {html.escape(cfg.schedule)}</h1><table border=1>"
        f"<tr>{''.join(f'<th>{html.escape(h)}</th>' for h in head)}</tr>{cells}</table>"
        + "".join(
            f"<p>{html.escape(r.target.label)}: {r.status} {html.escape(r.message)}</p>" for r in results if r.message
        )
        + "</body></html>\n"
    )
    fig, ax = plt.subplots(figsize=(min(30, 2 + 1.6 * len(head)), 1 + 0.4 * (len(rows) + 1)))
    ax.axis("off")
    tab = ax.table(cellText=rows or [["–"] * len(head)], colLabels=head, loc="center")
    tab.auto_set_font_size(False)
    tab.set_fontsize(7)
    colours = {"ok": "#d9f2d9", "regressed": "#ffe0b3", "failed": "#f8c8c8"}
    for i, r in enumerate(rows):
        tab[i + 1, 3].set_facecolor(colours.get(r[3], "white"))
    fig.savefig(paths["png"], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return paths


def log_result(r: VersionResult, cfg: ReevalConfig, paths: dict[str, Path], commit: str) -> None:
    """The ``stage=reeval`` run (in the study's experiment) and the version's ``reeval.*`` tags."""
    c = MlflowClient(cfg.tracking_uri)
    t = r.target
    exp = c.get_run(t.tags["study_run_id"]).info.experiment_id
    digest = manifest_digest(t.manifest)
    run = c.create_run(
        exp,
        run_name=f"reeval {t.name} v{t.version}",
        tags={
            "stage": "reeval",
            "model_name": t.name,
            "model_version": t.version,
            "dataset_digest": digest,
            "registered_dataset_digest": t.tags.get("dataset_digest", ""),
            "git_commit": commit,
            "schedule": cfg.schedule,
            "status": r.status,
            "reason": r.message[:4000],
            "study": t.tags.get("study", ""),
            "dataset": t.tags.get("dataset", ""),
            "loss": t.tags.get("loss", ""),
        },
    )
    rid = run.info.run_id
    r.run_id = rid
    with_ids = [x["model_id"] for x in t.reproductions if x.get("model_id")]
    if with_ids:
        c.log_inputs(rid, models=[LoggedModelInput(m) for m in with_ids])
    log_dataset_input(
        c,
        rid,
        {
            "name": t.tags.get("dataset", "dataset"),
            "digest": digest[:32],
            "sha256": digest,
            "uri": t.dataset_uri,
            "kind": "parquet",
            "profile": {"num_images": t.manifest["num_images"]},
        },
        "test",
    )
    c.log_param(rid, "tolerance", cfg.tolerance)
    now = int(time.time() * 1000)
    metrics = [
        Metric("reeval.images", r.images, now, 0),
        Metric("reeval.seconds", r.seconds, now, 0),
        Metric("reeval.embed_seconds", r.embed_seconds, now, 0),
    ]
    for mode, d in r.ci.items():
        for k, (m, lo, hi) in d.items():
            for part, v in (("mean", m), ("ci_low", lo), ("ci_high", hi)):
                if math.isfinite(v):
                    metrics.append(Metric(f"test.{mode}.{k}.{part}", float(v), now, 0))
    for key, v in r.verdicts.items():
        metrics.append(Metric(f"{key}.change", v["now"] - v["registered"], now, 0))
    c.log_batch(rid, metrics=metrics)
    c.log_text(rid, json.dumps(r.verdicts, indent=2, sort_keys=True), "reeval/verdicts.json")
    for p in paths.values():
        c.log_artifact(rid, str(p), "reeval")
    c.set_terminated(rid, "FAILED" if r.status == "failed" else "FINISHED")
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    c.set_model_version_tag(t.name, t.version, "reeval.status", r.status)
    c.set_model_version_tag(t.name, t.version, "reeval.last", f"{stamp} run {rid} schedule {cfg.schedule}")


def run_reeval(cfg: ReevalConfig, out=None) -> int:
    """Resolve (ConfigError before Ray), evaluate every version, write and log the table; the exit status."""
    out = out or sys.stdout
    # Resolving reads each version's folds.json from MLflow: no download progress bars in a scheduled job's log.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    targets = resolve_versions(cfg)
    print(
        f"reeval {cfg.schedule!r}: {len(targets)} model versions: " + ", ".join(t.label for t in targets),
        file=out,
        flush=True,
    )
    started = start_ray(cfg)
    results = []
    try:
        for t in targets:
            try:
                r = evaluate_version(t, cfg)
            except Exception as e:  # one version failing never stops the others
                r = VersionResult(
                    t,
                    "failed",
                    f"{t.label}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:400] if str(e).strip() else ''}",
                )
            results.append(r)
            print(
                f"  {t.label}: {r.status.upper()}"
                + (
                    f" ({r.images} images embedded in {r.embed_seconds:.1f} s, {r.seconds:.1f} s total)"
                    if r.images
                    else ""
                )
                + (f" — {r.message}" if r.message else ""),
                file=out,
                flush=True,
            )
    finally:
        stop_ray(started)  # also puts back what init_ray moved out of the environment
    paths = write_outputs(results, cfg)
    commit = git_commit()
    for r in results:
        try:
            log_result(r, cfg, paths, commit)
        except Exception as e:  # the table is written; say what could not be logged
            print(f"  {r.target.label}: could not log the reeval run: {e}", file=out, flush=True)
            r.status = "failed"
    print(paths["md"].read_text(), file=out, flush=True)
    print("written: " + ", ".join(str(p) for p in paths.values()), file=out, flush=True)
    if any(r.status == "failed" for r in results):
        return 1
    if any(r.status == "regressed" for r in results):
        return 3
    return 0
