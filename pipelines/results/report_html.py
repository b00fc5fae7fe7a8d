"""The report as one HTML file that works offline: the tables of the markdown, and one page (section) per dataset with
the losses' retrieval galleries side by side on the same queries, their embedding maps and their worst classes (with
the classes they are confused with), images embedded as data URIs."""

from __future__ import annotations

import base64
import html
import itertools
from typing import Any

from pipelines.names import MODES
from pipelines.results.report_cells import (
    BOUND_NOTE,
    bound_text,
    confused_text,
    cost_rows,
    flag_notes,
    fmt_ci,
    num_text,
    params_text,
    result_rows,
    worst_classes,
)
from pipelines.results.report_expected import EXPECTED_NOTE, expected_curves, expected_rows
from pipelines.results.report_markdown import best_group_lines
from pipelines.results.report_paired import ALPHA, POWER, best_groups, paired_summary, verdict
from pipelines.results.report_studies import Study, ranked

__all__ = ["render_html"]


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
    g: dict[str, Any] = next((s.visuals["gallery"] for s in shown if "gallery" in s.visuals), {})
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
                f"<figure><figcaption><b>{esc(s.loss)}</b> — MAP@R {fmt_ci(*s.cell('concat', 'map_at_r'))}"
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
        worst = worst_classes(s, 10)
        if not worst:
            continue
        out.append(
            f"<figure><figcaption><b>{esc(s.loss)}</b></figcaption><table><tr><th>class</th><th>queries</th>"
            "<th>MAP@R</th><th>RP</th><th>P@1</th><th>confused with</th></tr>"
        )
        out += [
            f"<tr><td>{esc(c['class_name'])}</td><td>{c['queries']}</td><td>{100 * c['map_at_r']:.1f}</td>"
            f"<td>{100 * c['r_precision']:.1f}</td><td>{100 * c['precision_at_1']:.1f}</td>"
            f"<td>{esc(confused_text(c))}</td></tr>"
            for c in worst
        ]
        out.append("</table></figure>")
    out.append("</div></section>")
    return out


def _markdown_tables(lines: list[str]) -> list[str]:
    """The markdown of :func:`best_group_lines` as HTML: headings, paragraphs, tables, list items."""
    out: list[str] = []
    table = False
    for line in lines:
        if line.startswith("|"):
            if set(line) <= set("|-"):
                continue
            cells = [c.strip() for c in line.strip("|").split("|")]
            tag = "th" if not table else "td"
            out.append(
                ("<table>" if not table else "")
                + "<tr>"
                + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells)
                + "</tr>"
            )
            table = True
            continue
        if table:
            out.append("</table>")
            table = False
        if line.startswith("### "):
            out.append(f"<h3>{html.escape(line[4:])}</h3>")
        elif line.startswith("- "):
            out.append(f"<p>{html.escape(line[2:])}</p>")
        elif line:
            out.append(f"<p>{html.escape(line.replace('**', ''))}</p>")
    return out + (["</table>"] if table else [])


def _anchor(dataset: str) -> str:
    return "dataset-" + "".join(ch if ch.isalnum() else "-" for ch in dataset)


def render_html(studies: list[Study], comparisons: list[dict[str, Any]]) -> str:
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
        header, rows = result_rows(studies, mode)
        parts.append(
            f"<h2>{html.escape(mode)}</h2><table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"
        )
        parts += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows]
        parts.append("</table>")
    parts += [f"<p>{html.escape(line.replace('*', '').removeprefix('- '))}</p>" for line in flag_notes(studies) if line]
    if any("cost.cpu_seconds" in s.metrics or s.training for s in studies):
        header, rows = cost_rows(studies)
        parts.append("<h2>Cost</h2><table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows]
        parts.append("</table>")
    if any(s.best_params for s in studies):
        parts.append(
            f"<h2>Winning hyperparameters</h2><p>{html.escape(BOUND_NOTE.replace('*', ''))}</p><table><tr>"
            "<th>dataset</th><th>loss</th><th>best trial</th><th>on a bound</th></tr>"
        )
        parts += [
            f"<tr><td>{html.escape(s.dataset)}</td><td>{html.escape(s.loss)}</td><td>{html.escape(params_text(s))}</td>"
            f"<td>{html.escape(bound_text(s) or '–')}</td></tr>"
            for s in ranked(studies)
        ]
        parts.append("</table>")
    groups = best_groups(studies)
    if any(g["members"] or g.get("reason") for g in groups.values()):
        parts.append(
            "<h2>Which losses may be the best</h2><p>Per dataset, concatenated test MAP@R ×100. Method: "
            f"{html.escape(next(iter(groups.values()))['method'])}. Gap found with {100 * POWER:.0f} % power: the true "
            "gap to the leader a one-sided paired t-test finds with that power, at the family's Bonferroni level "
            "(corrected) and at 5 % two-sided (uncorrected).</p>"
        )
        parts += _markdown_tables(best_group_lines(groups))
    summary = paired_summary(studies, comparisons)
    if summary:
        parts.append(
            "<h2>Against the baseline</h2><p>Concatenated test MAP@R ×100 over reproductions with the same seeds. "
            "p (Holm): Holm–Bonferroni over the comparisons against the baseline on the dataset; <i>not "
            "distinguishable below X points</i>: the test would find a true gap of X points with "
            f"{100 * POWER:.0f} % power, smaller ones go unseen. Every pair: paired_tests.csv.</p>"
        )
        for (dataset, ref, _), grouped in itertools.groupby(
            summary, key=lambda c: (c["dataset"], c["reference"], c["kind"])
        ):
            against = list(grouped)
            parts.append(
                f"<h3>{html.escape(dataset)}: against {html.escape(ref)}</h3>"
                f"<p>Family: {html.escape(against[0]['family'])}.</p><table><tr><th>loss</th>"
                f"<th>mean(loss − {html.escape(ref)})</th><th>t</th><th>p</th>"
                f"<th>p (Holm)</th><th>n</th><th>at Holm p &lt; {ALPHA}</th></tr>"
            )
            parts += [
                f"<tr><td>{html.escape(c['loss'])}</td><td>{100 * c['mean_diff']:+.2f}</td>"
                f"<td>{num_text(c['t'], '.3f')}</td><td>{num_text(c['p'], '.4f')}</td>"
                f"<td>{num_text(c['p_holm'], '.4f')}</td>"
                f"<td>{c['n']}</td><td>{html.escape(verdict(c))}</td></tr>"
                for c in against
            ]
            parts.append("</table>")
    curves = expected_curves(studies)
    if curves:
        header, rows = expected_rows(curves)
        parts.append(f"<h2>Expected validation performance</h2><p>{html.escape(EXPECTED_NOTE)}</p><table><tr>")
        parts.append("".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows]
        parts.append("</table>")
    if any(s.visuals for s in studies):
        for d in datasets:
            parts += _dataset_page(d, [s for s in ranked(studies) if s.dataset == d])
    return "\n".join(parts)
