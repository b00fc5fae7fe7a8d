"""The report as markdown: the results tables, cost, paired t-tests, winning hyperparameters and worst classes."""

from __future__ import annotations

import itertools
import math
from typing import Any

from pipelines.names import MODES
from pipelines.results.fingerprint import first_difference
from pipelines.results.report_cells import (
    BOUND_NOTE,
    bound_text,
    confused_text,
    cost_rows,
    flag_notes,
    num_text,
    params_text,
    result_rows,
    worst_classes,
)
from pipelines.results.report_expected import EXPECTED_NOTE, expected_curves, expected_rows
from pipelines.results.report_paired import ALPHA, POWER, best_groups, paired_summary, verdict
from pipelines.results.report_studies import Study, ranked

__all__ = ["render_markdown"]


def _summary_lines(summary: list[dict[str, Any]]) -> list[str]:
    lines = []
    for (dataset, ref, kind), grouped in itertools.groupby(
        summary, key=lambda c: (c["dataset"], c["reference"], c["kind"])
    ):
        rows = list(grouped)
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
            f"| {c['loss']} | {100 * c['mean_diff']:+.2f} | {num_text(c['t'], '.3f')} | {num_text(c['p'], '.4f')} | "
            f"{num_text(c['p_holm'], '.4f')} | {c['n']} "
            f"| {verdict(c)} |"
            for c in rows
        ]
        lines.append("")
    return lines


def best_group_lines(groups: dict[str, dict[str, Any]]) -> list[str]:
    """Per dataset: the best group's method, every loss's verdict with its adjusted p, and the gap to the leader a
    test would have found with 80 % power (markdown)."""
    lines: list[str] = []
    for dataset, g in groups.items():
        lines += [f"### {dataset}", ""]
        if not g["members"]:
            lines += [f"No best group: {g['reason']}.", ""]
            continue
        size = sum(m["in_group"] for m in g["members"])
        lines += [
            f"**Best group on {dataset}** ({size} of {len(g['members'])} losses, n = {g['n']} reproductions, "
            f"{g['family_size']} ordered pairs in the Holm family): "
            + ", ".join(m["loss"] for m in g["members"] if m["in_group"]),
            "",
            f"| rank | loss | mean ×100 | verdict | adjusted p | better loss | mean(loss − {g['leader']}) "
            f"| gap found with {100 * POWER:.0f} % power: corrected / uncorrected |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for rank, m in enumerate(g["members"], 1):
            gap = (
                f"{100 * m['detectable_diff']:.2f} / {100 * m['detectable_diff_uncorrected']:.2f}"
                if m["loss"] != g["leader"] and math.isfinite(m["detectable_diff"])
                else "–"
            )
            lines.append(
                f"| {rank} | {m['loss']} | {100 * m['mean']:.2f} | {m['verdict']} | {num_text(m['p_adjusted'], '.4f')} "
                f"| {m['beaten_by'] if not m['in_group'] else '–'} | "
                f"{'–' if m['loss'] == g['leader'] else format(100 * m['mean_diff'], '+.2f')} | {gap} |"
            )
        if g["left_out"]:
            lines.append("")
            lines += [f"- not in the comparison: {x['loss']} ({x['reason']})" for x in g["left_out"]]
        lines.append("")
    return lines


def _protocol_lines(studies: list[Study]) -> list[str]:
    """Per dataset, the protocol fingerprint its studies share — or, where they differ, a warning naming the first
    differing field: such rows do not compare like for like."""
    lines = []
    for dataset, grouped in itertools.groupby(sorted(studies, key=lambda s: s.dataset), key=lambda s: s.dataset):
        group = list(grouped)
        known = [(s, s.fingerprint) for s in group if s.fingerprint is not None]
        hashes = {fp.hash for _, fp in known}
        bundles = sorted({s.source for s in group if s.source != "mlflow"})
        source = f"; with the studies of {', '.join(bundles)}" if bundles else ""
        if len(hashes) == 1 and len(known) == len(group):
            lines.append(f"Protocol fingerprint on {dataset}: `{hashes.pop()}` (every study){source}.")
        elif len(hashes) > 1:
            a, a_fp = known[0]
            b, b_fp = next((s, fp) for s, fp in known if fp.hash != a_fp.hash)
            difference = first_difference(a_fp, b_fp)
            assert difference is not None  # the hash is of the fields: another hash, another field
            field, vb, va = difference
            lines.append(
                f"**Not comparable on {dataset}**: the studies ran {len(hashes)} different protocols, e.g. {a.loss} "
                f"and {b.loss} differ in `{field}` ({va!r} vs {vb!r}); read rows of different protocols apart."
            )
        else:
            lines.append(f"Protocol fingerprint on {dataset}: not recorded by every study (runs that predate it).")
    return [*lines, ""] if lines else []


def render_markdown(studies: list[Study], comparisons: list[dict[str, Any]]) -> str:
    lines = [
        "# Reality-check report",
        "",
        "Values are ×100, mean ± half-width of the 95 % t-interval across reproductions.",
        "",
        *_protocol_lines(studies),
    ]
    for mode in MODES:
        header, rows = result_rows(studies, mode)
        title = (
            "Concatenated (fold embeddings L2-normalised, concatenated)"
            if mode == "concat"
            else "Separated (mean over fold models)"
        )
        lines += [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines.append("")
    lines += flag_notes(studies)
    if any("cost.cpu_seconds" in s.metrics or s.training for s in studies):
        header, rows = cost_rows(studies)
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
    groups = best_groups(studies)
    if any(g["members"] or g.get("reason") for g in groups.values()):
        method = next(iter(groups.values()))["method"]
        lines += [
            "## Which losses may be the best (per dataset, concatenated test MAP@R ×100)",
            "",
            f"Method: {method}. The leader (rank 1) is only the highest mean; every loss *in the best group* may be "
            'the best. *Adjusted p*: the smallest Holm-adjusted p of "another loss is better than this one". '
            f"*Gap found with {100 * POWER:.0f} % power*: the true gap to the leader that a one-sided paired t-test "
            "would find with that power at its n, at the family's Bonferroni level α / m (*corrected*; Holm rejects "
            "at least as much) and at 5 % two-sided without correction (*uncorrected*): a loss in the group may "
            "still be worse than the leader by less than that.",
            "",
        ]
        lines += best_group_lines(groups)
    summary = paired_summary(studies, comparisons)
    if summary:
        lines += [
            "## Against the baseline (paired t-tests, concatenated test MAP@R ×100, same seeds)",
            "",
            "*p (Holm)* is p adjusted by Holm–Bonferroni over the comparisons against the baseline on the dataset. "
            "*Not distinguishable below X points*: the two-sided test at the family's Bonferroni level would find a "
            f"true gap of X points with {100 * POWER:.0f} % power at its n; smaller gaps go unseen, so it does not "
            "mean equal. Every pair: `paired_tests.csv` (its `p_holm`: Holm–Bonferroni over every pair of the dataset; "
            "`detectable_diff`: the same power statement for that family).",
            "",
        ]
        lines += _summary_lines(summary)
    curves = expected_curves(studies)
    if curves:
        header, rows = expected_rows(curves)
        lines += [
            "## Expected validation performance",
            "",
            EXPECTED_NOTE + " Figure: `expected_validation.png`.",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "---|" * len(header),
        ]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines.append("")
    if any(s.best_params for s in studies):
        lines += ["## Winning hyperparameters (best Bayesian-optimisation trial, retrained by the reproductions)", ""]
        if any(s.on_bound for s in studies):
            lines += [BOUND_NOTE, ""]
        lines += [
            f"- **{s.dataset} / {s.loss}**: {params_text(s)}{bound_text(s, ' — **on a bound**: ')}"
            for s in ranked(studies)
        ]
        lines.append("")
    with_pc = [s for s in studies if worst_classes(s, 1)]
    if with_pc:
        lines += [
            "## Worst test classes (reproduction 0, concatenated embedding)",
            "",
            "Per-class MAP@R ×100; in brackets how often the class's queries retrieved another class within R.",
            "",
        ]
        for s in ranked(with_pc):
            lines.append(
                f"- **{s.dataset} / {s.loss}**: "
                + "; ".join(
                    f"{c['class_name']} {100 * c['map_at_r']:.1f} (confused with {confused_text(c)})"
                    for c in worst_classes(s, 5)
                )
            )
        lines.append("")
    return "\n".join(lines)
