"""``dmlrc report``: one table of every study in an MLflow experiment.

Rows are losses; columns are dataset × metric, each as ``mean ± half-width`` of the 95 % t-interval
across reproductions, for the concatenated and the separated evaluation (docs/protocol.md §Test evaluation).
Written as markdown, CSV, HTML and a PNG bar chart with CI whiskers, and logged to MLflow as a
``stage=report`` run.  Where two losses were reproduced on the same folds and seeds, a paired t-test
on the reproduction runs gives a p-value per pair (``dml_core.stats.paired_t_test``).

Where the study runs carry the visuals of :mod:`pipelines.results.visuals`, the HTML gets one page (section) per
dataset: the losses' retrieval galleries side by side on the same queries, their embedding maps and their worst classes
(with the classes they are confused with); the markdown lists the worst classes.  Images are embedded as data URIs,
so the HTML stays one file that works offline.

Cost: a table of CPU-hours and GPU-hours per loss and dataset (the study runs' ``cost.cpu_seconds`` /
``cost.gpu_seconds``, summed over every fold of the study's trials and reproductions; the diverged trials' share
in brackets), in every format.

The run tree it reads is documented in ``docs/architecture.md`` ("MLflow tree").
"""

from __future__ import annotations

import base64
import collections
import csv
import html
import io
import itertools
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
from mlflow.tracking import MlflowClient

from dml_core.stats import holm_adjust, paired_t_test, paired_untestable
from pipelines.names import HEADLINE_METRICS, METRIC_LABELS, MODES, study_key
from pipelines.results.bounds import ON_BOUND_TAG, BoundHit, on_bound, params_from_descriptions, parse_tag
from pipelines.results.study_results import EPOCH0_NOTE, EPOCH0_TAG
from pipelines.results.untrained import untrained_metrics_of
from pipelines.tracking.runs import search_all

__all__ = ["Study", "collect_studies", "render_markdown", "write_report", "paired_comparisons", "paired_summary"]


@dataclass
class Study:
    """One (dataset, loss) study run and its reproduction runs."""

    run_id: str
    dataset: str
    loss: str
    metrics: dict[str, float]
    #: reproduction index → {"test.concat.map_at_r": ..., ...}
    reproductions: dict[int, dict[str, float]] = field(default_factory=dict)
    #: reproduction index → seed (pairing requires equal seeds)
    seeds: dict[int, str] = field(default_factory=dict)
    #: the study's ``visuals/`` artifacts (pipelines.results.visuals), if it has them: gallery/per_class (parsed JSON),
    #: gallery_png/map_png (bytes)
    visuals: dict[str, Any] = field(default_factory=dict)
    #: the winning trial's hyperparameters (the study run's ``best.<name>`` params)
    best_params: dict[str, str] = field(default_factory=dict)
    #: the ``sweep`` tag of the study run (fold runs are matched to it by ``sweep`` and ``study``)
    sweep: str = ""
    #: how its finished fold runs (trials' and reproductions') ended: ``folds``, ``improving`` (best validation at the
    #: last evaluation: still improving when the epoch cap ended it), ``epochs`` (mean epochs trained)
    training: dict[str, float] = field(default_factory=dict)
    #: every reproduction fold's best checkpoint at epoch 0 (the sweep's tag, pipelines.results.study_results)
    best_at_epoch_0: bool = False
    #: the untrained network's test metrics (``untrained.*`` of the study run, pipelines.results.untrained)
    untrained: dict[str, float] = field(default_factory=dict)
    #: the winning values on a bound of their searched range (pipelines.results.bounds)
    on_bound: list[BoundHit] = field(default_factory=list)

    def cell(self, mode: str, metric: str) -> tuple[float, float, float]:
        key = f"test.{mode}.{metric}"
        get = self.metrics.get
        return get(f"{key}.mean", math.nan), get(f"{key}.ci_low", math.nan), get(f"{key}.ci_high", math.nan)


def collect_studies(client: MlflowClient, experiment: str) -> list[Study]:
    """Every finished study of ``experiment`` (newest first wins if a (dataset, loss) repeats)."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        known = sorted(e.name for e in client.search_experiments())
        raise ValueError(
            f"--experiment: no MLflow experiment named {experiment!r} (have: {', '.join(known) or 'none'})"
        )
    studies: dict[tuple[str, str], Study] = {}
    for run in sorted(search_all(client, exp.experiment_id, "tags.stage = 'study'"), key=lambda r: -r.info.start_time):
        tags = run.data.tags
        key = (tags.get("dataset", "?"), tags.get("loss", "?"))
        if key in studies or not any(k.startswith("test.") for k in run.data.metrics):
            continue
        studies[key] = Study(
            run.info.run_id,
            key[0],
            key[1],
            dict(run.data.metrics),
            best_params={k[len("best.") :]: v for k, v in sorted(run.data.params.items()) if k.startswith("best.")},
            sweep=tags.get("sweep", ""),
            best_at_epoch_0=tags.get(EPOCH0_TAG) == "true",
            untrained=untrained_metrics_of(run.data.metrics),
            on_bound=_bound_hits(run),
        )
    by_id = {s.run_id: s for s in studies.values()}
    for run in search_all(client, exp.experiment_id, "tags.stage = 'reproduction'"):
        study = by_id.get(run.data.tags.get("mlflow.parentRunId", ""))
        if study is None or "reproduction" not in run.data.tags:
            continue
        i = int(run.data.tags["reproduction"])
        study.reproductions[i] = {k: v for k, v in run.data.metrics.items() if k.startswith("test.")}
        study.seeds[i] = run.data.tags.get("seed", "")
    _collect_training(client, exp.experiment_id, list(studies.values()))
    return sorted(studies.values(), key=lambda s: (s.dataset, s.loss))


def _bound_hits(run) -> list[BoundHit]:
    """A study run's winning values on a bound: the sweep's tag, else (runs that predate it) recomputed from the
    logged ``space.<name>`` and ``best.<name>`` params."""
    if ON_BOUND_TAG in run.data.tags:
        return parse_tag(run.data.tags[ON_BOUND_TAG])
    params = run.data.params
    space = params_from_descriptions({k[len("space.") :]: v for k, v in params.items() if k.startswith("space.")})
    return on_bound(space, {k[len("best.") :]: v for k, v in params.items() if k.startswith("best.")})


def _collect_training(client: MlflowClient, experiment_id: str, studies: list[Study]) -> None:
    """Fill ``study.training`` from the finished fold runs: a fold whose best validation MAP@R came at its last
    evaluation (``best_epoch == epoch``) was still improving when the epoch cap stopped it; the others were stopped
    by ``patience`` (or peaked earlier)."""
    by_key = {(s.sweep, study_key(s.dataset, s.loss)): s for s in studies}
    folds: dict[int, list[tuple[float, float]]] = {}
    for run in search_all(client, experiment_id, "tags.stage = 'fold' and tags.status = 'ok'"):
        s = by_key.get((run.data.tags.get("sweep", ""), run.data.tags.get("study", "")))
        m = run.data.metrics
        if s is not None and "epoch" in m and "best_epoch" in m:
            folds.setdefault(id(s), []).append((m["epoch"], m["best_epoch"]))
    for s in studies:
        rows = folds.get(id(s))
        if rows:
            s.training = {
                "folds": len(rows),
                "improving": sum(1 for epoch, best in rows if best >= epoch),
                "epochs": float(np.mean([epoch for epoch, _ in rows])),
            }


def _training_cell(s: Study | None) -> str:
    if s is None or not s.training:
        return "–"
    t = s.training
    return f"{t['improving']}/{t['folds']} ({100 * t['improving'] / t['folds']:.0f} %), {t['epochs']:.2f} epochs"


_VISUALS = {
    "gallery": "visuals/gallery.json",
    "per_class": "visuals/per_class.json",
    "gallery_png": "visuals/gallery.png",
    "map_png": "visuals/embedding_map.png",
}


def collect_visuals(client: MlflowClient, studies: list[Study]) -> None:
    """Fill ``study.visuals`` from each study run's ``visuals/`` artifacts (absent for sweeps that predate them)."""
    for s in studies:
        have = {a.path for a in client.list_artifacts(s.run_id, "visuals")}
        with tempfile.TemporaryDirectory() as tmp:
            for key, path in _VISUALS.items():
                if path not in have:
                    continue
                data = Path(client.download_artifacts(s.run_id, path, tmp)).read_bytes()
                s.visuals[key] = json.loads(data) if path.endswith(".json") else data


def _worst(s: Study, n: int) -> list[dict[str, Any]]:
    pc = s.visuals.get("per_class") or {}
    by_label = {c["label"]: c for c in pc.get("classes", [])}
    return [by_label[l] for l in pc.get("worst", [])[:n] if l in by_label]


def _confused(c: dict[str, Any]) -> str:
    return ", ".join(f"{x['class_name']} ({x['count']})" for x in c.get("confused_with", [])) or "–"


def _fmt(mean: float, low: float, high: float) -> str:
    if math.isnan(mean):
        return "–"
    if math.isnan(low) or math.isnan(high):
        return f"{100 * mean:.2f} (CI undefined)"
    return f"{100 * mean:.2f} ± {100 * (high - low) / 2:.2f}"


def _grid(studies: list[Study]) -> tuple[list[str], list[str]]:
    """Datasets by name; losses ranked by their mean concatenated test MAP@R over the datasets (best first, ties and
    losses without the metric by name), so that a sweep of many losses reads as a ranking."""
    scores: dict[str, list[float]] = {}
    for s in studies:
        v = s.cell("concat", "map_at_r")[0]
        scores.setdefault(s.loss, [])
        if math.isfinite(v):
            scores[s.loss].append(v)
    rank = {loss: -float(np.mean(v)) if v else math.inf for loss, v in scores.items()}
    return sorted({s.dataset for s in studies}), sorted(scores, key=lambda loss: (rank[loss], loss))


def _ranked(studies: list[Study]) -> list[Study]:
    """``studies`` by dataset, then in the losses' ranking (:func:`_grid`)."""
    _, losses = _grid(studies)
    order = {loss: i for i, loss in enumerate(losses)}
    return sorted(studies, key=lambda s: (s.dataset, order[s.loss]))


def _rows(studies: list[Study], mode: str) -> tuple[list[str], list[list[str]]]:
    datasets, losses = _grid(studies)
    index = {(s.dataset, s.loss): s for s in studies}
    header = ["loss"] + [f"{d} {METRIC_LABELS[m]}" for d in datasets for m in HEADLINE_METRICS]
    rows = []
    for loss in losses:
        row = [loss]
        for d in datasets:
            s = index.get((d, loss))
            row += [_flagged(_fmt(*s.cell(mode, m)), s) if s else "–" for m in HEADLINE_METRICS]
        rows.append(row)
    if any(s.untrained for s in studies):
        rows.append([_UNTRAINED_ROW] + [_untrained_cell(studies, d, m) for d in datasets for m in HEADLINE_METRICS])
    return header, rows


_EPOCH0_MARK = "best at epoch 0"
_UNTRAINED_ROW = "untrained network (reference)"


def _flagged(cell: str, s: Study) -> str:
    """A results cell of ``s``, marked when its best checkpoints are all the untrained network's."""
    return f"{cell} ({_EPOCH0_MARK})" if s.best_at_epoch_0 and cell != "–" else cell


def _untrained_cell(studies: list[Study], dataset: str, metric: str) -> str:
    """The untrained network's ``metric`` on ``dataset`` ×100; "–" when unknown, "varies" when the dataset's studies
    used different networks (each study's value is in the JSON)."""
    values = {s.untrained[metric] for s in studies if s.dataset == dataset and metric in s.untrained}
    return "–" if not values else f"{100 * values.pop():.2f}" if len(values) == 1 else "varies by loss"


def _flag_notes(studies: list[Study]) -> list[str]:
    """What the results tables' reference row and marks mean (one paragraph each), as markdown."""
    lines = []
    if any(s.untrained for s in studies):
        lines += [
            f"*{_UNTRAINED_ROW}*: the studies' network with its initial weights on the same test classes, not trained "
            "(one network, the same value in both modes): the floor the losses are measured against.",
            "",
        ]
    flagged = [f"{s.dataset} / {s.loss}" for s in _ranked(studies) if s.best_at_epoch_0]
    if flagged:
        lines += [f"**{_EPOCH0_MARK.capitalize()}** ({', '.join(flagged)}): {EPOCH0_NOTE}.", ""]
    return lines


def paired_comparisons(studies: list[Study], mode: str = "concat", metric: str = "map_at_r") -> list[dict[str, Any]]:
    """Paired t-tests between every two losses of a dataset over reproductions with the same seed; ``p_holm`` is p
    adjusted by Holm–Bonferroni over every pair of the dataset (the family of ``paired_tests.csv``)."""
    out = []
    for dataset, group in itertools.groupby(studies, key=lambda s: s.dataset):
        for a, b in itertools.combinations(list(group), 2):
            key = f"test.{mode}.{metric}"
            common = sorted(
                i
                for i in set(a.reproductions) & set(b.reproductions)
                if a.seeds.get(i) == b.seeds.get(i) and key in a.reproductions[i] and key in b.reproductions[i]
            )
            if len(common) < 2:
                continue
            xa = [a.reproductions[i][key] for i in common]
            xb = [b.reproductions[i][key] for i in common]
            t, p = paired_t_test(xa, xb)
            out.append(
                {
                    "dataset": dataset,
                    "loss_a": a.loss,
                    "loss_b": b.loss,
                    "metric": key,
                    "n": len(common),
                    "mean_diff": sum(x - y for x, y in zip(xa, xb)) / len(common),
                    "t": t,
                    "p": p,
                    "untestable": paired_untestable(xa, xb),  # why t and p are NaN, else None
                }
            )
    _add_holm(out, lambda c: c["dataset"])
    return out


def _add_holm(rows: list[dict[str, Any]], family) -> None:
    """Set ``p_holm`` of every row: its p adjusted by Holm–Bonferroni over the rows with the same ``family(row)``
    (NaN p-values stay NaN and are not counted: :func:`dml_core.stats.holm_adjust`)."""
    groups: dict[Any, list[dict[str, Any]]] = {}
    for c in rows:
        groups.setdefault(family(c), []).append(c)
    for group in groups.values():
        for c, adjusted in zip(group, holm_adjust([c["p"] for c in group])):
            c["p_holm"] = float(adjusted)


#: The reality check's reference loss: every loss is also compared with it.
BASELINE = "contrastive"


def paired_summary(
    studies: list[Study], comparisons: list[dict[str, Any]], baseline: str = BASELINE
) -> list[dict[str, Any]]:
    """Per dataset, each loss against the dataset's best loss (highest mean concatenated test MAP@R) and against
    ``baseline``: ``{dataset, loss, reference, mean_diff (loss − reference), p, p_holm, family, n}`` — the two
    questions a table of many losses is read for (which losses cannot be told apart from the best, which beat the
    baseline), instead of every pair (all pairs stay in the JSON and in ``paired_tests.csv``).  Each reference's
    comparisons on a dataset are one Holm–Bonferroni family (``family`` names it): the comparisons against the best
    and those against the baseline answer separate questions, so each is corrected for its own size."""
    index = {(c["dataset"], c["loss_a"], c["loss_b"]): c for c in comparisons}
    out = []
    for dataset in sorted({s.dataset for s in studies}):
        group = [s for s in _ranked(studies) if s.dataset == dataset]
        refs = [group[0].loss] + ([baseline] if any(s.loss == baseline for s in group) else [])
        for ref in dict.fromkeys(refs):
            for s in group:
                if s.loss == ref:
                    continue
                c = index.get((dataset, s.loss, ref))
                sign = 1
                if c is None:
                    c, sign = index.get((dataset, ref, s.loss)), -1
                if c is None:
                    continue
                out.append(
                    {
                        "dataset": dataset,
                        "loss": s.loss,
                        "reference": ref,
                        "kind": "best" if ref == group[0].loss else "baseline",
                        "metric": c["metric"],
                        "n": c["n"],
                        "mean_diff": sign * c["mean_diff"],
                        "t": sign * c["t"],
                        "p": c["p"],
                        "untestable": c["untestable"],
                    }
                )
    _add_holm(out, lambda c: (c["dataset"], c["reference"]))
    sizes = collections.Counter((c["dataset"], c["reference"]) for c in out if not math.isnan(c["p"]))
    for c in out:
        c["family"] = (
            f"Holm–Bonferroni over the {sizes[(c['dataset'], c['reference'])]} comparisons against {c['reference']} "
            f"on {c['dataset']}, {_metric_text(c['metric'])}"
        )
    return out


def _metric_text(key: str) -> str:
    """``test.concat.map_at_r`` → ``concatenated test MAP@R``."""
    _, mode, metric = key.split(".", 2)
    return f"{'concatenated' if mode == 'concat' else mode} test {METRIC_LABELS.get(metric, metric)}"


#: The level at which a (Holm-adjusted) p-value tells two losses apart.
ALPHA = 0.05


def top_group(studies: list[Study], summary: list[dict[str, Any]], alpha: float = ALPHA) -> dict[str, list[str]]:
    """Per dataset, the best loss and the losses *not distinguishable* from it: Holm-adjusted p ≥ ``alpha`` against
    the best, or no p at all because the two losses' values are identical.  A loss without a paired test against
    the best (fewer than 2 reproductions with common seeds) is not in it."""
    out = {d: [next(group).loss] for d, group in itertools.groupby(_ranked(studies), key=lambda s: s.dataset)}
    for c in summary:
        if c["kind"] == "best" and not (math.isfinite(c["p_holm"]) and c["p_holm"] < alpha):
            out[c["dataset"]].append(c["loss"])
    return out


def _num(v: float, spec: str) -> str:
    """A test statistic or p-value as printed; "–" where the test gave none (NaN)."""
    return "–" if isinstance(v, float) and math.isnan(v) else format(v, spec)


def _verdict(c: dict[str, Any], alpha: float = ALPHA) -> str:
    if c.get("untestable"):
        return f"not testable ({c['untestable']})"
    p = c.get("p_holm", c["p"])  # judged on the adjusted p where the row is part of a family
    if not (isinstance(p, float) and math.isfinite(p)) or p >= alpha:
        return "not distinguishable"
    return "better" if c["mean_diff"] > 0 else "worse"


def _summary_lines(summary: list[dict[str, Any]]) -> list[str]:
    lines = []
    for (dataset, ref, kind), rows in itertools.groupby(
        summary, key=lambda c: (c["dataset"], c["reference"], c["kind"])
    ):
        rows = list(rows)
        what = "the best loss" if kind == "best" else "the baseline"
        lines += [
            f"### {dataset}: against {ref} ({what})",
            "",
            f"Family: {rows[0]['family']}.",
            "",
            f"| loss | mean(loss − {ref}) | t | p | p (Holm) | n | at Holm p < {ALPHA} |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {c['loss']} | {100 * c['mean_diff']:+.2f} | {_num(c['t'], '.3f')} | {_num(c['p'], '.4f')} | "
            f"{_num(c['p_holm'], '.4f')} | {c['n']} "
            f"| {_verdict(c)} |"
            for c in rows
        ]
        lines.append("")
    return lines


def _write_paired_csv(comparisons: list[dict[str, Any]], path: Path) -> None:
    buf = io.StringIO()
    w = csv.writer(buf)
    keys = ("dataset", "loss_a", "loss_b", "metric", "n", "mean_diff", "t", "p", "p_holm", "untestable")
    w.writerow(keys)
    for c in comparisons:
        w.writerow([c[k] for k in keys])
    path.write_text(buf.getvalue())


def _hours(s: Study, kind: str, part: str = "") -> float:
    v = s.metrics.get(f"cost.{part}{kind}_seconds")
    return v / 3600 if isinstance(v, (int, float)) else math.nan


def _cost_cell(s: Study | None) -> str:
    """``CPU-h / GPU-h`` of a study, the diverged trials' share in brackets; "–" for a study without cost metrics."""
    if s is None or math.isnan(_hours(s, "cpu")):
        return "–"
    cell = f"{_hours(s, 'cpu'):.3g} / {_hours(s, 'gpu'):.3g}"
    div = _hours(s, "cpu", "diverged.")
    return cell + (f" ({div:.3g} / {_hours(s, 'gpu', 'diverged.'):.3g} diverged)" if div > 0 else "")


def _cost_rows(studies: list[Study]) -> tuple[list[str], list[list[str]]]:
    """One row per loss; per dataset its cost (CPU-hours / GPU-hours) and, where fold runs were found, how many of
    its folds were still improving when training ended (with the mean epochs trained)."""
    datasets, losses = _grid(studies)
    index = {(s.dataset, s.loss): s for s in studies}
    training = any(s.training for s in studies)
    header = ["loss"]
    for d in datasets:
        header += [f"{d} cost (CPU-h / GPU-h)"] + ([f"{d} folds still improving at the end"] if training else [])
    rows = []
    for loss in losses:
        row = [loss]
        for d in datasets:
            s = index.get((d, loss))
            row += [_cost_cell(s)] + ([_training_cell(s)] if training else [])
        rows.append(row)
    return header, rows


def _cost_json(s: Study) -> dict[str, float]:
    out = {k[len("cost.") :]: v for k, v in s.metrics.items() if k.startswith("cost.")}
    if out:
        out.update(cpu_hours=_hours(s, "cpu"), gpu_hours=_hours(s, "gpu"))
    return out


def _short_value(v: str) -> str:
    """A parameter as logged (MLflow params are strings) with floats cut to 4 significant digits for reading."""
    try:
        return v if float(v).is_integer() and "." not in v else f"{float(v):.4g}"
    except ValueError:
        return v


_BOUND_NOTE = (
    "*On a bound*: the winning value lies on an edge of its searched range (within 0.1 % of the range, on the "
    "search's scale), so the best value may lie outside the range searched."
)


def _bound_text(s: Study, prefix: str = "") -> str:
    """``prefix`` + the study's winning values on a bound (``loss_lr at lower bound 1e-06; …``), or ``""``."""
    return prefix + "; ".join(h.describe() for h in s.on_bound) if s.on_bound else ""


def _params(s: Study) -> str:
    return ", ".join(f"{k}={_short_value(v)}" for k, v in s.best_params.items()) or "(nothing searched)"


def render_markdown(studies: list[Study], comparisons: list[dict[str, Any]]) -> str:
    lines = [
        "# Reality-check report",
        "",
        "Values are ×100, mean ± half-width of the 95 % t-interval across reproductions.",
        "",
    ]
    for mode in MODES:
        header, rows = _rows(studies, mode)
        title = (
            "Concatenated (fold embeddings L2-normalised, concatenated)"
            if mode == "concat"
            else "Separated (mean over fold models)"
        )
        lines += [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines.append("")
    lines += _flag_notes(studies)
    if any("cost.cpu_seconds" in s.metrics or s.training for s in studies):
        header, rows = _cost_rows(studies)
        lines += [
            "## Cost (all folds of the study's trials and reproductions)",
            "",
            "A fold *still improving at the end* had its best validation MAP@R at its last evaluation: the epoch cap, "
            "not `patience`, ended it, so more training would probably have helped.",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "---|" * len(header),
        ]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines.append("")
    summary = paired_summary(studies, comparisons)
    if summary:
        lines += [
            "## Paired t-tests (concatenated test MAP@R ×100, reproductions with the same seeds)",
            "",
            "Each loss against the best one and against the baseline. *p (Holm)* is p adjusted by Holm–Bonferroni "
            "over the table's family, named above each table: on a dataset, the comparisons against the best are "
            "one family and those against the baseline another. *Not distinguishable* is judged on the adjusted p. "
            "With few reproductions the test has little power: *not distinguishable* means no difference was shown, "
            "not that there is none. Every pair: `paired_tests.csv` (its `p_holm`: Holm–Bonferroni over every pair "
            "of the dataset).",
            "",
        ]
        lines += _summary_lines(summary)
        lines += [
            f"**Top group on {d}** (the best loss and those not distinguishable from it): {', '.join(g)}"
            for d, g in top_group(studies, summary).items()
        ] + [""]
    if any(s.best_params for s in studies):
        lines += ["## Winning hyperparameters (best Bayesian-optimisation trial, retrained by the reproductions)", ""]
        if any(s.on_bound for s in studies):
            lines += [_BOUND_NOTE, ""]
        lines += [
            f"- **{s.dataset} / {s.loss}**: {_params(s)}{_bound_text(s, ' — **on a bound**: ')}"
            for s in _ranked(studies)
        ]
        lines.append("")
    with_pc = [s for s in studies if _worst(s, 1)]
    if with_pc:
        lines += [
            "## Worst test classes (reproduction 0, concatenated embedding)",
            "",
            "Per-class MAP@R ×100; in brackets how often the class's queries retrieved another class within R.",
            "",
        ]
        for s in _ranked(with_pc):
            lines.append(
                f"- **{s.dataset} / {s.loss}**: "
                + "; ".join(
                    f"{c['class_name']} {100 * c['map_at_r']:.1f} (confused with {_confused(c)})" for c in _worst(s, 5)
                )
            )
        lines.append("")
    return "\n".join(lines)


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _dataset_page(dataset: str, studies: list[Study]) -> list[str]:
    """One dataset's page: galleries side by side (same queries), embedding maps, worst classes per loss."""
    esc = html.escape
    shown = [s for s in studies if s.visuals]
    out = [f"<section class='page' id='{esc(_anchor(dataset))}'><h2>{esc(dataset)}</h2>"]
    if not shown:
        return out + ["<p>No visuals logged for this dataset's studies.</p></section>"]
    queries = {s.loss: [q["test_index"] for q in s.visuals.get("gallery", {}).get("queries", [])] for s in shown}
    same = len({tuple(v) for v in queries.values()}) == 1
    g = next((s.visuals["gallery"] for s in shown if "gallery" in s.visuals), {})
    out.append(
        f"<h3>Retrieval galleries</h3><p>The same {len(g.get('queries', []))} test queries (seed "
        f"{g.get('seed')}) for every loss, one per row: the query (blue) then its top-{g.get('k')} references "
        "among the other test images, <span style='color:#1a9850'>✓ green = same class</span>, "
        "<span style='color:#d73027'>✗ red = another class</span>; captions are the class names. "
        "Embedding: reproduction 0, fold embeddings concatenated (docs/protocol.md §Test evaluation).</p>"
    )
    if not same:
        out.append(
            "<p class='warn'>Warning: these studies' galleries use different queries (different test sets "
            "or settings); rows do not correspond.</p>"
        )
    out.append("<div class='row'>")
    for s in shown:
        if "gallery_png" in s.visuals:
            out.append(
                f"<figure><figcaption><b>{esc(s.loss)}</b> — MAP@R {_fmt(*s.cell('concat', 'map_at_r'))}"
                f"</figcaption><img class='gallery' alt='retrieval gallery of {esc(s.loss)}' "
                f"src='{_data_uri(s.visuals['gallery_png'])}'></figure>"
            )
    out.append(
        "</div><h3>Embedding maps</h3><p>PCA of the test embeddings of the same sampled classes for every "
        "loss, coloured by class.</p><div class='row'>"
    )
    for s in shown:
        if "map_png" in s.visuals:
            out.append(
                f"<figure><figcaption><b>{esc(s.loss)}</b></figcaption><img class='map' alt='embedding map of "
                f"{esc(s.loss)}' src='{_data_uri(s.visuals['map_png'])}'></figure>"
            )
    out.append(
        "</div><h3>Worst classes</h3><p>Per-class metrics ×100 (the class's queries averaged); "
        "'confused with': the other classes among its queries' first R neighbours, with counts.</p>"
        "<div class='row'>"
    )
    for s in shown:
        worst = _worst(s, 10)
        if not worst:
            continue
        out.append(
            f"<figure><figcaption><b>{esc(s.loss)}</b></figcaption><table><tr><th>class</th><th>queries</th>"
            "<th>MAP@R</th><th>RP</th><th>P@1</th><th>confused with</th></tr>"
        )
        out += [
            f"<tr><td>{esc(c['class_name'])}</td><td>{c['queries']}</td><td>{100 * c['map_at_r']:.1f}</td>"
            f"<td>{100 * c['r_precision']:.1f}</td><td>{100 * c['precision_at_1']:.1f}</td>"
            f"<td>{esc(_confused(c))}</td></tr>"
            for c in worst
        ]
        out.append("</table></figure>")
    out.append("</div></section>")
    return out


def _anchor(dataset: str) -> str:
    return "dataset-" + "".join(ch if ch.isalnum() else "-" for ch in dataset)


def _render_html(studies: list[Study], comparisons: list[dict[str, Any]]) -> str:
    parts = [
        "<!doctype html><meta charset='utf-8'><title>Reality-check report</title>",
        "<style>body{font-family:sans-serif}td,th{padding:2px 8px;border:1px solid #ccc}"
        "table{border-collapse:collapse}.row{display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start}"
        "figure{margin:0;flex:0 0 auto}img.gallery{width:720px}img.map{width:560px}.warn{color:#d73027}"
        "nav a{margin-right:12px}</style>",
        "<h1>Reality-check report</h1>",
    ]
    datasets = sorted({s.dataset for s in studies})
    if any(s.visuals for s in studies):
        parts.append(
            "<nav>Dataset pages: "
            + " ".join(f"<a href='#{html.escape(_anchor(d))}'>{html.escape(d)}</a>" for d in datasets)
            + "</nav>"
        )
    parts.append("<p>×100, mean ± half-width of the 95 % t-interval across reproductions.</p>")
    for mode in MODES:
        header, rows = _rows(studies, mode)
        parts.append(
            f"<h2>{html.escape(mode)}</h2><table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"
        )
        parts += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows]
        parts.append("</table>")
    parts += [f"<p>{html.escape(line.replace('*', ''))}</p>" for line in _flag_notes(studies) if line]
    if any("cost.cpu_seconds" in s.metrics or s.training for s in studies):
        header, rows = _cost_rows(studies)
        parts.append("<h2>Cost</h2><table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows]
        parts.append("</table>")
    if any(s.best_params for s in studies):
        parts.append(
            f"<h2>Winning hyperparameters</h2><p>{html.escape(_BOUND_NOTE.replace('*', ''))}</p><table><tr>"
            "<th>dataset</th><th>loss</th><th>best trial</th><th>on a bound</th></tr>"
        )
        parts += [
            f"<tr><td>{html.escape(s.dataset)}</td><td>{html.escape(s.loss)}</td><td>{html.escape(_params(s))}</td>"
            f"<td>{html.escape(_bound_text(s) or '–')}</td></tr>"
            for s in _ranked(studies)
        ]
        parts.append("</table>")
    summary = paired_summary(studies, comparisons)
    if summary:
        parts.append(
            "<h2>Paired t-tests</h2><p>Concatenated test MAP@R ×100 over reproductions with the same seeds; each "
            "loss against the best one and against the baseline. p (Holm): Holm–Bonferroni-adjusted over the family "
            "named above each table; <i>not distinguishable</i> is judged on it. Every pair: paired_tests.csv "
            "(p_holm: over every pair of the dataset).</p>"
        )
        for (dataset, ref, _), rows in itertools.groupby(
            summary, key=lambda c: (c["dataset"], c["reference"], c["kind"])
        ):
            rows = list(rows)
            parts.append(
                f"<h3>{html.escape(dataset)}: against {html.escape(ref)}</h3>"
                f"<p>Family: {html.escape(rows[0]['family'])}.</p><table><tr><th>loss</th>"
                f"<th>mean(loss − {html.escape(ref)})</th><th>t</th><th>p</th>"
                f"<th>p (Holm)</th><th>n</th><th>at Holm p &lt; {ALPHA}</th></tr>"
            )
            parts += [
                f"<tr><td>{html.escape(c['loss'])}</td><td>{100 * c['mean_diff']:+.2f}</td>"
                f"<td>{_num(c['t'], '.3f')}</td><td>{_num(c['p'], '.4f')}</td><td>{_num(c['p_holm'], '.4f')}</td>"
                f"<td>{c['n']}</td><td>{_verdict(c)}</td></tr>"
                for c in rows
            ]
            parts.append("</table>")
        parts += [
            f"<p><b>Top group on {html.escape(d)}</b> (the best loss and those not distinguishable from it): "
            f"{html.escape(', '.join(g))}</p>"
            for d, g in top_group(studies, summary).items()
        ]
    if any(s.visuals for s in studies):
        for d in datasets:
            parts += _dataset_page(d, [s for s in _ranked(studies) if s.dataset == d])
    return "\n".join(parts)


def _write_csv(studies: list[Study], path: Path) -> None:
    buf = io.StringIO()
    w = csv.writer(buf)
    header = ["dataset", "loss", "mode", "metric", "mean", "ci_low", "ci_high", "n_reproductions", "study_run_id"]
    w.writerow(header + ["on_bound"])
    for s in studies:
        for mode in MODES:
            for m in HEADLINE_METRICS:
                row = [s.dataset, s.loss, mode, m, *s.cell(mode, m), len(s.reproductions), s.run_id, _bound_text(s)]
                w.writerow(row)
    path.write_text(buf.getvalue())


def _bar_chart(studies: list[Study], path: Path, metric: str = "map_at_r") -> None:
    # matplotlib (slow to import) only for the chart; the Agg backend must be chosen before pyplot is imported
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"), as said above

    # Horizontal bars, best loss on top: the figure grows in height with the number of losses, and the loss names
    # stay horizontal and readable however many there are.
    datasets, losses = _grid(studies)
    index = {(s.dataset, s.loss): s for s in studies}
    panels = len(MODES) * len(datasets)
    fig, axes = plt.subplots(
        1, panels, figsize=(1.5 + 4.5 * panels, 1.2 + 0.32 * len(losses)), squeeze=False, sharey=True
    )
    y = np.arange(len(losses))[::-1]
    for ax, (mode, d) in zip(axes[0], itertools.product(MODES, datasets)):
        cells = [index[(d, l)].cell(mode, metric) if (d, l) in index else (math.nan,) * 3 for l in losses]
        means = np.array([c[0] for c in cells]) * 100
        err = np.array([[c[0] - c[1], c[2] - c[0]] for c in cells]).T * 100
        ax.barh(y, means, xerr=np.nan_to_num(err), capsize=3, color="#4c72b0")
        ax.set_yticks(y, losses)
        ax.set_title(f"{d} · {mode}")
        ax.set_xlabel(f"{METRIC_LABELS[metric]} (×100, 95 % CI)")
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(
    tracking_uri: str, experiment: str, out_dir: str | Path, *, log_to_mlflow: bool = True
) -> dict[str, Path]:
    """Write report.{md,csv,html,json,png} and paired_tests.csv into ``out_dir`` and (optionally) log them as a
    ``stage=report`` run."""
    client = MlflowClient(tracking_uri=tracking_uri)
    studies = collect_studies(client, experiment)
    if not studies:
        raise ValueError(
            f"--experiment {experiment!r}: no finished study runs (tag stage=study with test.* metrics) yet"
        )
    comparisons = paired_comparisons(studies)
    summary = paired_summary(studies, comparisons)
    collect_visuals(client, studies)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {ext: out / f"report.{ext}" for ext in ("md", "csv", "html", "json", "png")}
    paths["paired_csv"] = out / "paired_tests.csv"
    paths["md"].write_text(render_markdown(studies, comparisons))
    paths["html"].write_text(_render_html(studies, comparisons))
    _write_csv(studies, paths["csv"])
    _write_paired_csv(comparisons, paths["paired_csv"])
    paths["json"].write_text(
        json.dumps(
            {
                "experiment": experiment,
                "studies": [
                    {
                        "dataset": s.dataset,
                        "loss": s.loss,
                        "run_id": s.run_id,
                        "test": {k: v for k, v in s.metrics.items() if k.startswith("test.")},
                        "n_reproductions": len(s.reproductions),
                        "best_params": s.best_params,
                        "on_bound": [{"param": h.param, "bound": h.side, "value": h.bound} for h in s.on_bound],
                        "cost": _cost_json(s),
                        "training": s.training,
                        "best_at_epoch_0": s.best_at_epoch_0,
                        "untrained": s.untrained,
                        **({"worst_classes": _worst(s, 10)} if _worst(s, 1) else {}),
                    }
                    for s in studies
                ],
                "paired_tests": comparisons,
                "paired_summary": summary,
                "top_group": top_group(studies, summary),
            },
            indent=2,
            default=float,
        )
    )
    _bar_chart(studies, paths["png"])
    if log_to_mlflow:
        exp_id = client.get_experiment_by_name(experiment).experiment_id
        run = client.create_run(exp_id, run_name="report", tags={"stage": "report"})
        for p in paths.values():
            client.log_artifact(run.info.run_id, str(p), artifact_path="report")
        client.set_terminated(run.info.run_id)
    return paths


def add_report_parser(subparsers) -> None:
    p = subparsers.add_parser("report", help="table of every study in an MLflow experiment (md, csv, html, png)")
    p.add_argument("--experiment", default=None, help="MLflow experiment name (one per sweep; required)")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI)")
    p.add_argument("--out", default="report", help="output directory (default: ./report)")
    p.add_argument("--no-log", action="store_true", help="do not log the report to MLflow")
    p.set_defaults(func=run_report)


def run_report(args) -> int:
    # One progress bar per downloaded artifact would bury the table under two bars per study.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    uri = args.tracking_uri or mlflow.get_tracking_uri()
    paths = write_report(uri, args.experiment, args.out, log_to_mlflow=not args.no_log)
    print(paths["md"].read_text())
    print("written: " + ", ".join(str(p) for p in paths.values()))
    return 0
