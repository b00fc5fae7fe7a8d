"""``dmlrc report --compare EXP_A EXP_B``: does a second run of the same preset rank the losses the same way?

Two MLflow experiments (two complete sweeps of one preset, with different seeds; in one store, or EXP_B in the
store named by ``--compare-tracking-uri``) are read as ``dmlrc report`` reads one (:func:`collect_studies`), keeping
the (dataset, loss) studies both have.  Per dataset, with the losses ranked by mean concatenated test MAP@R:

* **Kendall's τ** (``scipy.stats.kendalltau``, τ-b) with an approximate 95 % interval from Fisher's z
  transformation, ``atanh(τ) ± 1.96·√(0.437 / (n − 4))`` (Fieller, Hartley & Pearson 1957; needs at least 5 losses
  and |τ| < 1), and **Spearman's ρ** (``scipy.stats.spearmanr``), with their p-values (against "no association", not
  against "identical").  With fewer than 3 losses a rank correlation says nothing and is reported as undefined
  (``null`` with a reason), never as ±1;
* the **between-search spread**: per loss, run B's mean minus run A's, and their typical size next to the runs' own
  95 % half-widths;
* the **best group** of each run (:func:`pipelines.results.report_paired.best_groups`), and the losses whose
  membership differs: their place is *not established*;
* every **pairwise conclusion** (paired t-test over the run's reproductions, Holm–Bonferroni over every pair of the
  dataset: "x better", "y better", "not distinguishable", "not testable" for identical values, "not tested" without
  two common seeds) that differs between the two runs: such a conclusion is *not established*.

``compare.json`` is standard JSON: an undefined number is ``null`` with a reason beside it.

Everything is computed on the common losses only, so that a second run of a subset (e.g. the first run's top 10)
is compared on the same footing: its rankings, families and best groups are those of that subset in both runs.
Written as ``compare.json`` and ``compare.md`` into ``--out`` and printed.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import mlflow
from mlflow.tracking import MlflowClient

from pipelines.config import ConfigError, check_tracking_uri
from pipelines.results.report_cells import json_safe
from pipelines.results.report_paired import ALPHA, best_groups, paired_comparisons, top_group
from pipelines.results.report_studies import Study, collect_studies
from pipelines.tracking.server import check_mlflow_server

__all__ = [
    "compare_studies",
    "compare_experiments",
    "render_compare_markdown",
    "add_compare_option",
    "check_compare_args",
]

_METRIC = ("concat", "map_at_r")
#: the settings a preset fixes: two runs that differ in them are not two runs of one preset
_SETTINGS = ("trials", "startup_trials", "reproductions", "classes_per_batch", "m")


def _studies(client: MlflowClient, experiment: str) -> list[Study]:
    try:
        studies = collect_studies(client, experiment)
    except ValueError as e:  # "--experiment: no MLflow experiment named ..."
        raise ValueError("--compare: " + str(e).removeprefix("--experiment: ")) from None
    if not studies:
        raise ValueError(f"--compare: {experiment!r} has no finished study runs (tag stage=study with test.* metrics)")
    return studies


#: The level of Kendall's τ interval.
_TAU_CI_LEVEL = 0.95

_RANK_KEYS = ("kendall_tau", "kendall_p", "kendall_tau_ci", "spearman_rho", "spearman_p")


def _rank_stats(xs: list[float], ys: list[float]) -> dict[str, Any]:
    """Rank correlations of two runs' scores; an undefined value is ``None`` with its reason in ``*_reason``."""
    if len(xs) < 3:
        reason = (
            f"undefined with {len(xs)} loss(es): two rankings of fewer than 3 losses agree or disagree completely "
            "whatever the data, so τ and ρ carry no information"
        )
        return {k: None for k in _RANK_KEYS} | {"rank_reason": reason, "kendall_tau_ci_reason": reason}
    # scipy.stats (2 s of CPU) only for a --compare, not for every dmlrc command (which imports this module's option)
    from scipy import stats

    with warnings.catch_warnings():  # a constant input: scipy warns and returns NaN, which is the answer
        warnings.simplefilter("ignore")
        tau, spearman = stats.kendalltau(xs, ys), stats.spearmanr(xs, ys)
    out: dict[str, Any] = {
        "kendall_tau": float(tau.statistic),
        "kendall_p": float(tau.pvalue),
        "spearman_rho": float(spearman.statistic),
        "spearman_p": float(spearman.pvalue),
    }
    if not math.isfinite(out["kendall_tau"]):
        out["rank_reason"] = "undefined: one run gives every loss the same score"
    z = float(stats.norm.isf((1 - _TAU_CI_LEVEL) / 2))
    out["kendall_tau_ci"], why = _tau_interval(out["kendall_tau"], len(xs), z)
    if why:
        out["kendall_tau_ci_reason"] = why
    return out


def _tau_interval(tau: float, n: int, z: float) -> tuple[list[float] | None, str | None]:
    """Fisher-z interval of Kendall's τ: ``tanh(atanh(τ) ± z·√(0.437/(n − 4)))`` (Fieller, Hartley & Pearson 1957),
    ``z`` the normal quantile of the level (two-sided)."""
    if not math.isfinite(tau):
        return None, "τ is undefined"
    if n < 5:
        return None, f"the Fisher-z interval needs at least 5 losses (have {n})"
    if abs(tau) >= 1.0:
        return None, "τ = ±1: the Fisher-z interval degenerates to a point (it has no width at the boundary)"
    half = z * math.sqrt(0.437 / (n - 4))
    centre = math.atanh(tau)
    return [math.tanh(centre - half), math.tanh(centre + half)], None


def _conclusion(c: dict[str, Any] | None, alpha: float) -> str:
    """One run's conclusion about a pair from its paired test ``c`` (``None``: no test)."""
    if c is None:
        return "not tested"
    p = c["p_holm"]
    if math.isnan(p):
        return "not testable"
    if p >= alpha:
        return "not distinguishable"
    return f"{c['loss_a'] if c['mean_diff'] > 0 else c['loss_b']} better"


def compare_studies(
    studies_a: list[Study], studies_b: list[Study], names: tuple[str, str] = ("A", "B"), alpha: float = ALPHA
) -> dict[str, Any]:
    """The comparison of two runs' studies (see the module docstring) as a JSON-ready dict."""
    common = {(s.dataset, s.loss) for s in studies_a} & {(s.dataset, s.loss) for s in studies_b}
    out: dict[str, Any] = {"experiments": list(names), "alpha": alpha, "metric": "test.concat.map_at_r", "datasets": []}
    for dataset in sorted({d for d, _ in common}):
        runs = [
            [s for s in studies if (s.dataset, s.loss) in common and s.dataset == dataset]
            for studies in (studies_a, studies_b)
        ]
        score = [{s.loss: s.cell(*_METRIC)[0] for s in run} for run in runs]
        losses = sorted(x for x in score[0] if math.isfinite(score[0][x]) and math.isfinite(score[1][x]))
        runs = [[s for s in run if s.loss in losses] for run in runs]
        if not losses:
            continue
        ranking = [sorted(losses, key=lambda x: (-sc[x], x)) for sc in score]  # sorted at once: sc is this run's
        tests = [paired_comparisons(run) for run in runs]
        tops = [top_group(best_groups(run, alpha=alpha)).get(dataset, []) for run in runs]
        index = [{frozenset((c["loss_a"], c["loss_b"])): c for c in t} for t in tests]
        pairs, flips = 0, []
        for x, y in itertools.combinations(ranking[0], 2):  # each pair in run A's order: the better of the two first
            pairs += 1
            verdicts = [_conclusion(ix.get(frozenset((x, y))), alpha) for ix in index]
            if verdicts[0] != verdicts[1]:
                flips.append(
                    {"pair": [x, y], names[0]: verdicts[0], names[1]: verdicts[1], "status": "not established"}
                )
        diffs = {x: score[1][x] - score[0][x] for x in ranking[0]}
        half = [
            (s.cell(*_METRIC)[2] - s.cell(*_METRIC)[1]) / 2
            for run in runs
            for s in run
            if math.isfinite(s.cell(*_METRIC)[1])
        ]
        out["datasets"].append(
            {
                "dataset": dataset,
                "losses": len(losses),
                **_rank_stats([score[0][x] for x in losses], [score[1][x] for x in losses]),
                "ranking": {
                    x: {names[i]: {"rank": ranking[i].index(x) + 1, "map_at_r": score[i][x]} for i in (0, 1)}
                    | {"diff": diffs[x]}
                    for x in ranking[0]
                },
                "spread": {
                    "mean_abs_diff": sum(abs(v) for v in diffs.values()) / len(diffs),
                    "max_abs_diff": max(abs(v) for v in diffs.values()),
                    "median_ci_half_width": sorted(half)[len(half) // 2] if half else None,
                },
                "top_group": {names[0]: tops[0], names[1]: tops[1]},
                "top_group_agrees": set(tops[0]) == set(tops[1]),
                "best_group_not_established": sorted(set(tops[0]) ^ set(tops[1])),
                "pairs": pairs,
                "flips": flips,
            }
        )
    out["notes"] = _notes(studies_a, studies_b, common, names)
    return out


def _notes(studies_a: list[Study], studies_b: list[Study], common: set, names: tuple[str, str]) -> list[str]:
    notes = []
    for studies, name in ((studies_a, names[0]), (studies_b, names[1])):
        left = sorted(f"{s.dataset}/{s.loss}" for s in studies if (s.dataset, s.loss) not in common)
        if left:
            notes.append(f"left out, only in {name}: {', '.join(left)}")
    seeds = [{v for s in studies for v in s.seeds.values()} for studies in (studies_a, studies_b)]
    if seeds[0] and seeds[0] == seeds[1]:
        notes.append(
            "both runs used the same reproduction seeds: this compares two runs, not two seeds (set the preset's "
            "seed differently for a stability check)"
        )
    return notes


def _settings_notes(clients: tuple[MlflowClient, MlflowClient], a: list[Study], b: list[Study]) -> list[str]:
    """Where the two runs' studies were set up differently (trials, reproductions, batch, searched ranges)."""
    by_key = {(s.dataset, s.loss): s for s in b}
    notes = []
    for s in a:
        other = by_key.get((s.dataset, s.loss))
        if other is None:
            continue
        pa, pb = (
            {k: v for k, v in c.get_run(run_id).data.params.items() if k in _SETTINGS or k.startswith("space.")}
            for c, run_id in zip(clients, (s.run_id, other.run_id))
        )
        differ = sorted(k for k in pa.keys() | pb.keys() if pa.get(k) != pb.get(k))
        if differ:
            shown = "; ".join(f"{k}: {pa.get(k, '–')} vs {pb.get(k, '–')}" for k in differ)
            notes.append(f"{s.dataset}/{s.loss} was not run with the same settings: {shown}")
    return notes


def compare_experiments(
    tracking_uri: str, exp_a: str, exp_b: str, tracking_uri_b: str | None = None, alpha: float = ALPHA
) -> dict[str, Any]:
    """:func:`compare_studies` of two experiments (``exp_b`` in ``tracking_uri_b`` if given), with a note wherever
    their common studies were set up differently."""
    clients = (MlflowClient(tracking_uri=tracking_uri), MlflowClient(tracking_uri=tracking_uri_b or tracking_uri))
    a, b = _studies(clients[0], exp_a), _studies(clients[1], exp_b)
    common = {(s.dataset, s.loss) for s in a} & {(s.dataset, s.loss) for s in b}
    if not common:
        raise ValueError(f"--compare: {exp_a!r} and {exp_b!r} have no (dataset, loss) study in common")
    names = (exp_a, exp_b) if exp_a != exp_b else (f"{exp_a} (A)", f"{exp_b} (B)")
    out = compare_studies(a, b, names, alpha)
    out["notes"] += _settings_notes(clients, a, b)
    return out


def _f(v: float | None, spec: str = ".3f") -> str:
    return "–" if v is None or math.isnan(v) else format(v, spec)


def _times100(v: float | None) -> float | None:
    return None if v is None else 100 * v


def _tau_line(d: dict[str, Any]) -> str:
    if d["kendall_tau"] is None:
        return f"- Kendall's τ and Spearman's ρ: {d['rank_reason']}"
    ci = d["kendall_tau_ci"]
    ci_text = f"95 % CI {ci[0]:.3f} to {ci[1]:.3f}, Fisher z" if ci else f"no interval: {d['kendall_tau_ci_reason']}"
    return (
        f"- Kendall's τ = {_f(d['kendall_tau'])} ({ci_text}; p = {_f(d['kendall_p'], '.2g')}), Spearman's ρ = "
        f"{_f(d['spearman_rho'])} (p = {_f(d['spearman_p'], '.2g')})"
    )


def render_compare_markdown(result: dict[str, Any]) -> str:
    a, b = result["experiments"]
    lines = [
        f"# Ranking stability: {a} vs {b}",
        "",
        "Losses ranked by mean concatenated test MAP@R, on the losses both runs have. *Best group*: the losses no "
        "other loss beats (one-sided paired t-tests of every ordered pair, Holm–Bonferroni over all of them, "
        f"adjusted p ≤ {result['alpha']}). *Pairwise conclusions*: paired t-test of each pair, Holm–Bonferroni over "
        "every pair of the dataset, in each run. A conclusion or best-group membership that differs between the two "
        "searches is *not established*.",
        "",
    ]
    for d in result["datasets"]:
        top = d["top_group"]
        lines += [
            f"## {d['dataset']} ({d['losses']} losses)",
            "",
            _tau_line(d),
            f"- Between-search spread: |{b} − {a}| is {100 * d['spread']['mean_abs_diff']:.2f} points on average "
            f"(at most {100 * d['spread']['max_abs_diff']:.2f}); the runs' median 95 % half-width is "
            f"{_f(_times100(d['spread']['median_ci_half_width']), '.2f')}",
            f"- Best group {'agrees' if d['top_group_agrees'] else 'differs'}: {a}: {', '.join(top[a])}; "
            f"{b}: {', '.join(top[b])}"
            + (
                f" — not established: {', '.join(d['best_group_not_established'])}"
                if d["best_group_not_established"]
                else ""
            ),
            f"- Pairwise conclusions that flip (not established): {len(d['flips'])} of {d['pairs']} pairs",
            "",
            f"| loss | rank in {a} | MAP@R ×100 | rank in {b} | MAP@R ×100 | {b} − {a} |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {loss} | {r[a]['rank']} | {100 * r[a]['map_at_r']:.2f} | {r[b]['rank']} "
            f"| {100 * r[b]['map_at_r']:.2f} | {100 * r['diff']:+.2f} |"
            for loss, r in d["ranking"].items()
        ]
        lines.append("")
        if d["flips"]:
            lines += [f"| pair | {a} | {b} | conclusion |", "|---|---|---|---|"]
            lines += [f"| {x} vs {y} | {f[a]} | {f[b]} | {f['status']} |" for f in d["flips"] for x, y in [f["pair"]]]
            lines.append("")
    if result["notes"]:
        lines += ["## Notes", ""] + [f"- {n}" for n in result["notes"]] + [""]
    return "\n".join(lines)


def add_compare_option(report_parser) -> None:
    """``--compare EXP_A EXP_B`` (and ``--compare-tracking-uri``) on ``dmlrc report``'s parser: with it, the command
    compares two runs instead of writing one run's report."""
    report_parser.add_argument(
        "--compare",
        nargs=2,
        metavar=("EXP_A", "EXP_B"),
        default=None,
        help="compare the rankings of two runs of one preset (Kendall's τ, Spearman's ρ, best groups, flipped pairs) "
        "instead of writing a report; writes compare.json and compare.md into --out",
    )
    report_parser.add_argument(
        "--compare-tracking-uri",
        default=None,
        help="the MLflow store of EXP_B when it is not the one of --tracking-uri (e.g. each sweep's own sqlite DB)",
    )
    report = report_parser.get_default("func")

    def run(args) -> int:
        return run_compare(args) if args.compare else report(args)

    report_parser.set_defaults(func=run)


def check_compare_args(args) -> None:
    """What ``--compare`` is given, checked before MLflow is asked (as ``dmlrc report``'s own options are)."""
    if args.experiment is not None:
        raise ConfigError("--compare", "give either --experiment (one report) or --compare EXP_A EXP_B, not both")
    if not all(str(name).strip() for name in args.compare):
        raise ConfigError("--compare", "experiment names must not be empty")
    uri = args.compare_tracking_uri
    if uri is None:
        if args.compare[0] == args.compare[1]:
            raise ConfigError("--compare", f"EXP_A and EXP_B are the same experiment ({args.compare[0]!r})")
        return
    check_tracking_uri(uri, "--compare-tracking-uri")
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).is_file():
        raise ConfigError("--compare-tracking-uri", f"no sqlite DB at {uri[len('sqlite:///') :]!r}")
    if uri.startswith(("http://", "https://")):
        check_mlflow_server(uri, "--compare-tracking-uri")


def run_compare(args) -> int:
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    uri = args.tracking_uri or mlflow.get_tracking_uri()
    exp_a, exp_b = args.compare
    result = compare_experiments(uri, exp_a, exp_b, tracking_uri_b=args.compare_tracking_uri)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / "compare.md", out / "compare.json"
    md.write_text(render_compare_markdown(result))
    # standard JSON only: every undefined number is null (its reason beside it)
    js.write_text(json.dumps(json_safe(result), indent=2, allow_nan=False))
    print(md.read_text())
    print(f"written: {md}, {js}")
    return 0
