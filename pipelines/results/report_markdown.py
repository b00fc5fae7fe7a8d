"""The report as markdown: the results tables, cost, paired t-tests, winning hyperparameters and worst classes."""

from __future__ import annotations

import itertools
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
from pipelines.results.report_paired import ALPHA, paired_summary, top_group, verdict
from pipelines.results.report_studies import Study, ranked

__all__ = ["render_markdown"]


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
            f"| {c['loss']} | {100 * c['mean_diff']:+.2f} | {num_text(c['t'], '.3f')} | {num_text(c['p'], '.4f')} | "
            f"{num_text(c['p_holm'], '.4f')} | {c['n']} "
            f"| {verdict(c)} |"
            for c in rows
        ]
        lines.append("")
    return lines


def _protocol_lines(studies: list[Study]) -> list[str]:
    """Per dataset, the protocol fingerprint its studies share — or, where they differ, a warning naming the first
    differing field: such rows do not compare like for like."""
    lines = []
    for dataset, group in itertools.groupby(sorted(studies, key=lambda s: s.dataset), key=lambda s: s.dataset):
        group = list(group)
        known = [s for s in group if s.fingerprint is not None]
        hashes = {s.fingerprint.hash for s in known}
        bundles = sorted({s.source for s in group if s.source != "mlflow"})
        source = f"; with the studies of {', '.join(bundles)}" if bundles else ""
        if len(hashes) == 1 and len(known) == len(group):
            lines.append(f"Protocol fingerprint on {dataset}: `{hashes.pop()}` (every study){source}.")
        elif len(hashes) > 1:
            a = known[0]
            b = next(s for s in known if s.fingerprint.hash != a.fingerprint.hash)
            field, vb, va = first_difference(a.fingerprint, b.fingerprint)
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
