"""``dmlrc reeval CONFIG``: re-evaluate registered reality-check models on the current test data, with the current code.

Config (YAML): :mod:`pipelines.reeval.config` — its keys (``models``, ``datasets``, ``metrics``, ``tolerance``, ...),
the pydantic schema, the hardened loader and the published JSON Schema ``docs/reeval-config.schema.json``;
:func:`load_reeval_config` and :class:`ReevalConfig` are re-exported here.

Per model version (:func:`evaluate_version`): the test classes come from the study's fold manifest
(``folds.json``); Ray Data streams the dataset's parquet shards (``read_parquet`` → filter to the test classes →
``map_batches`` with actors that hold every reproduction's pyfunc model, one actor per GPU with ``use_gpu``) and
returns only the embeddings to the driver; the metrics are the sweep's own test step
(``retrieval_metrics`` per fold model → ``pipelines.execution.trial.reproduction_test_metrics``, concatenated with
``pipelines.execution.trial.concatenated_embeddings``), the intervals
``pipelines.results.study_results.confidence_intervals`` (95 % Student-t across reproductions,
docs/protocol.md §Test evaluation).

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
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dml_core.splits import FoldManifest
from dml_core.stats import confidence_interval
from pipelines.config.schema import ConfigError
from pipelines.execution.fold import _finite
from pipelines.execution.interrupts import install_startup_handlers
from pipelines.execution.ray_runtime import check_tracking_reachable, init_ray, stop_ray
from pipelines.names import ALIAS, MODES, REPRODUCTION
from pipelines.reeval.config import ReevalConfig, load_reeval_config
from pipelines.results.embeddings import reproduction_test_metrics, split_folds
from pipelines.results.study_results import confidence_intervals

__all__ = [
    "ReevalConfig",
    "load_reeval_config",
    "run_reeval",
    "add_reeval_parser",
    "regression_verdict",
    "manifest_digest",
]

# ------------------------------------------------------------------------------------------------ resolution


@dataclass
class Target:
    """One model version to re-evaluate, with what it is compared against."""

    name: str
    version: str
    tags: dict[str, str]
    dataset_uri: str
    manifest: dict
    test_classes: list[int]
    reproductions: list[dict[str, Any]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.name} version {self.version}"


def manifest_digest(manifest: dict) -> str:
    """sha256 of the canonical JSON of a parquet manifest (the digest ``pipelines.tracking.model_registry``
    registers)."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def resolve_versions(cfg: ReevalConfig) -> list[Target]:
    """Every version the config names, checked against MLflow and the datasets; ConfigError before Ray starts."""
    # MLflow: pipelines.cli imports this module to build its parser, before any command runs
    from mlflow.tracking import MlflowClient

    # pyarrow: see the MLflow import above
    from dml_core.shards import read_manifest

    for noisy in ("mlflow.store", "alembic"):  # a fresh sqlite store announces its migrations at INFO
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if cfg.tracking_uri.startswith(("http://", "https://")):
        check_tracking_reachable(cfg.tracking_uri)
    client = MlflowClient(cfg.tracking_uri)
    found: list[tuple[str, Any]] = []
    for i, m in enumerate(cfg.models):
        where = f"models[{i}]"
        try:
            if "name" in m:
                if "version" in m:
                    found.append((where, client.get_model_version(m["name"], str(m["version"]))))
                else:
                    found.append((where, client.get_model_version_by_alias(m["name"], m.get("alias", ALIAS))))
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
                f"{m.get('name')} "
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


# ------------------------------------------------------------------------------------------------ embedding


class _Embedder:
    """Ray Data actor: every reproduction's pyfunc model of one version, loaded once per actor."""

    def __init__(self, tracking_uri: str, model_uris: list[str], image_size: int, batch_size: int):
        # MLflow: see resolve_versions
        import mlflow

        # it imports MLflow's pyfunc: see resolve_versions
        from pipelines.tracking.pyfunc_model import preprocess

        mlflow.set_tracking_uri(tracking_uri)
        self.models = [mlflow.pyfunc.load_model(u) for u in model_uris]
        self.image_size, self.batch_size, self.preprocess = image_size, batch_size, preprocess
        # the trunk's input convention, as the sweep trained it (embedder.json; ImageNet RGB for older versions)
        self.preprocessing = self.models[0].unwrap_python_model().spec.get("preprocessing")

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        images = list(batch["image"])
        for img, digest, rel in zip(images, batch["sha256"], batch["relpath"]):
            if hashlib.sha256(img).hexdigest() != digest:
                raise ValueError(f"{rel}: image bytes do not match their sha256 (corrupt shard)")
        x = self.preprocess(images, self.image_size, self.preprocessing)
        out = {"label": np.asarray(batch["label"], dtype=np.int64)}
        for i, m in enumerate(self.models):
            out[f"rep{i}"] = np.asarray(
                m.predict(x, params={"output": "folds", "batch_size": self.batch_size}), dtype=np.float32
            )
        return out


def _filesystem(uri: str):
    """pyarrow filesystem + paths root for Ray Data (S3 endpoint from $AWS_ENDPOINT_URL[_S3] as the sweep uses it)."""
    if not uri.startswith("s3://"):
        return None, uri.rstrip("/")
    # pyarrow's S3 filesystem only for s3:// datasets (and see resolve_versions)
    import pyarrow.fs as pafs

    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    kwargs: dict[str, Any] = {}
    if endpoint:
        scheme, _, host = endpoint.partition("://")
        kwargs.update(endpoint_override=host or scheme, scheme=scheme if host else "https")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        kwargs["region"] = region
    return pafs.S3FileSystem(**kwargs), uri[len("s3://") :].rstrip("/")


def embed_version(t: Target, cfg: ReevalConfig) -> tuple[list[np.ndarray], np.ndarray, float]:
    """``([reproduction i's "folds" output (N, 4·d)], labels (N,), seconds)`` over the test classes, streamed."""
    # Ray: pipelines.cli imports this module to build its parser; Ray loads once _start_ray started it
    import ray
    import ray.data

    root = t.dataset_uri
    if root.endswith(".json"):
        root = root.rsplit("/", 1)[0]
    fs, base = _filesystem(root)
    paths = [f"{base}/{s['path']}" for s in t.manifest["shards"]]
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # the sweep embedded the test rows in shard order
    classes = set(t.test_classes)
    ds = ray.data.read_parquet(paths, filesystem=fs, columns=["image", "label", "sha256", "relpath"])
    ds = ds.filter(lambda row: int(row["label"]) in classes)
    n_gpu = int(ray.cluster_resources().get("GPU", 0)) if cfg.use_gpu else 0
    actors = max(1, n_gpu) if cfg.use_gpu else max(1, min(2, int(ray.cluster_resources().get("CPU", 1)) // 2))
    uris = [r["model_uri"] for r in t.reproductions]
    t0 = time.time()
    ds = ds.map_batches(
        _Embedder,
        fn_constructor_args=(cfg.tracking_uri, uris, int(t.tags.get("image_size", 227)), cfg.batch_size),
        batch_size=cfg.batch_size,
        concurrency=actors,
        num_gpus=1 if cfg.use_gpu else 0,
        batch_format="numpy",
    )
    labels, reps = [], [[] for _ in uris]
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        labels.append(batch["label"])
        for i in range(len(uris)):
            reps[i].append(batch[f"rep{i}"])
    seconds = time.time() - t0
    if not labels:
        raise RuntimeError(f"{t.dataset_uri}: no rows of the test classes")
    return [np.concatenate(r) for r in reps], np.concatenate(labels), seconds


# ------------------------------------------------------------------------------------------------ metrics


def reproduction_metrics(folds_output: np.ndarray, labels: np.ndarray, n_folds: int) -> dict[str, float]:
    """The sweep's test step on one reproduction's embeddings: separated + concatenated
    (``pipelines.execution.trial``)."""
    # faiss: see resolve_versions
    from dml_core.metrics import retrieval_metrics

    parts = split_folds(folds_output, n_folds)
    # fold_worker's "separated" call, per fold model: retrieval_metrics(test_emb, test_labels)
    outcomes = [{"test_metrics": _finite(retrieval_metrics(p, labels))} for p in parts]
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
    # it imports MLflow (the sweep's modules import it too): see resolve_versions
    from pipelines.tracking.model_registry import fluent_tracking

    with fluent_tracking(cfg.tracking_uri):
        return _evaluate_version(t, cfg)


def _evaluate_version(t: Target, cfg: ReevalConfig) -> VersionResult:
    # MLflow (the sweep's modules import it too): see resolve_versions
    import mlflow

    t0 = time.time()
    # A missing or corrupt artifact fails here, on the driver, with the version named (not deep inside Ray).
    spec = None
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
            old = [r["metrics"].get(key) for r in t.reproductions]
            new = [row.get(key.replace(".", "_")) for row in rows]
            if any(v is None for v in old + new):
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
    # matplotlib (slow to import) only for the chart; the Agg backend must be chosen before pyplot is imported
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"), as said above

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
    # MLflow: see resolve_versions
    from mlflow.entities import LoggedModelInput
    from mlflow.tracking import MlflowClient

    # imports MLflow too
    from pipelines.tracking.datasets import log_dataset_input

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
    with_ids = [x.get("model_id") for x in t.reproductions if x.get("model_id")]
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
    # MLflow: see resolve_versions
    from mlflow.entities import Metric

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


def _start_ray(cfg: ReevalConfig) -> bool:
    """The sweep's Ray start-up (:func:`pipelines.execution.ray_runtime.init_ray`: loopback only, credentials kept out
    of Ray's runtime_env, quiet loggers); a local Ray gets every core (embedding actors, one per CPU slot)."""
    started = init_ray(cfg.ray_address, num_cpus=max(2, os.cpu_count() or 1), address_field="ray_address")
    install_startup_handlers()  # Ray's driver installs a native SIGTERM handler: a CronJob's SIGTERM stays ours
    # Ray: see embed_version
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    return started


def run_reeval(cfg: ReevalConfig, out=None) -> int:
    """Resolve (ConfigError before Ray), evaluate every version, write and log the table; the exit status."""
    out = out or sys.stdout
    # MLflow: see resolve_versions
    from pipelines.tracking.runs import git_commit

    # Resolving reads each version's folds.json from MLflow: no download progress bars in a scheduled job's log.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    targets = resolve_versions(cfg)
    print(
        f"reeval {cfg.schedule!r}: {len(targets)} model versions: " + ", ".join(t.label for t in targets),
        file=out,
        flush=True,
    )
    started = _start_ray(cfg)
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


def add_reeval_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "reeval",
        help="re-evaluate registered models on the current test data "
        "(exit 0 ok, 3 regression, 1 failure, 2 bad config)",
    )
    p.add_argument("config", help="reeval config YAML (see infra/reeval/ and docs/architecture.md)")
    p.set_defaults(func=lambda args: run_reeval(load_reeval_config(args.config)))
