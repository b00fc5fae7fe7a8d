"""Re-state the verdicts of the published short-budget Omniglot zoo (docs/results/omniglot-zoo/short-budget/) with
the report's corrected statistics: the best group (dml_core.evaluation.selection.best_group), Holm-adjusted comparisons
with the baseline, and the gap each comparison finds with 80 % power
(dml_core.evaluation.stats.paired_detectable_difference).

The published files do not hold the per-reproduction values, but they hold enough to rebuild them up to a rotation
that no paired statistic sees:

* ``paired_tests.csv`` gives, for all 378 pairs, ``n``, the mean difference and ``t``, hence the spread of the paired
  differences ``sd_d = mean_diff · √n / t`` and the squared distance ``(n − 1)·sd_d²`` between the two losses'
  centred reproduction vectors (``x_l − mean_l``, which lie in the 2-D plane orthogonal to (1, 1, 1) for n = 3);
* classical multidimensional scaling of those distances (``scipy.linalg.eigh`` of the double-centred matrix) places
  the 28 centred vectors in that plane up to a shift, a rotation and a reflection; the plane's third and later
  eigenvalues must vanish, which checks the data;
* the shift is fixed by each loss's own spread (``report.json``'s 95 % interval: ``‖x_l − mean_l‖² = (n − 1)·sd_l²``,
  solved by ``scipy.optimize.least_squares``).

A rotation or reflection of the plane changes which seed holds which value but no mean, no spread of a loss and no
paired difference's mean or spread, so every paired t-test, the best group and every power statement are the same
for every such reconstruction.  The script checks that the rebuilt values give back all 378 published t statistics
and all 28 intervals, then prints the re-stated table (markdown) and the checks.

    .venv/bin/python bench/restate_short_budget.py [--dir docs/results/omniglot-zoo/short-budget]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

import numpy as np
from scipy import linalg, optimize, stats

from dml_core.evaluation.selection import METHOD, best_group
from dml_core.evaluation.stats import confidence_interval, holm_adjust, paired_detectable_difference, paired_t_test

KEY = "test.concat.map_at_r"
BASELINE = "contrastive"


def rebuild(folder: Path) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Per-reproduction values (n = 3) consistent with every published mean, interval and paired t; and the checks."""
    report = json.loads((folder / "report.json").read_text())
    pairs = list(csv.DictReader((folder / "paired_tests.csv").open()))
    means = {s["loss"]: s["test"][f"{KEY}.mean"] for s in report["studies"]}
    halfs = {s["loss"]: (s["test"][f"{KEY}.ci_high"] - s["test"][f"{KEY}.ci_low"]) / 2 for s in report["studies"]}
    n = {int(p["n"]) for p in pairs}
    if n != {3}:
        raise SystemExit(f"{folder / 'paired_tests.csv'}: this rebuild is for 3 reproductions, found n = {sorted(n)}")
    names = sorted(means)
    k = len(names)
    at = {name: i for i, name in enumerate(names)}
    d2 = np.zeros((k, k))
    for p in pairs:
        i, j = at[p["loss_a"]], at[p["loss_b"]]
        sd = float(p["mean_diff"]) * math.sqrt(3) / float(p["t"])
        d2[i, j] = d2[j, i] = 2 * sd**2  # (n − 1)·sd_d²
    centre = np.eye(k) - 1.0 / k
    eigval, eigvec = linalg.eigh(-0.5 * centre @ d2 @ centre)
    eigval, eigvec = eigval[::-1], eigvec[:, ::-1]
    y = eigvec[:, :2] * np.sqrt(eigval[:2])
    sd_loss = np.array([halfs[name] / stats.t.ppf(0.975, 2) * math.sqrt(3) for name in names])
    radius2 = 2 * sd_loss**2  # ‖x_l − mean_l‖² = (n − 1)·sd_l²

    def residual(u: np.ndarray) -> np.ndarray:
        return np.sqrt(((y + u) ** 2).sum(axis=1)) - np.sqrt(radius2)

    shift = optimize.least_squares(residual, np.zeros(2)).x
    plane = np.array([[1.0, -1.0, 0.0], [1.0, 1.0, -2.0]]) / np.array([[math.sqrt(2)], [math.sqrt(6)]])
    centred = (y + shift) @ plane
    values = {name: means[name] + centred[at[name]] for name in names}
    t_err = max(
        abs(paired_t_test(values[p["loss_a"]], values[p["loss_b"]])[0] - float(p["t"])) / abs(float(p["t"]))
        for p in pairs
    )
    ci_err = max(abs((lambda c: (c[2] - c[1]) / 2)(confidence_interval(values[name])) - halfs[name]) for name in names)
    checks = {
        "third eigenvalue / second": float(abs(eigval[2]) / eigval[1]),
        "max relative error of the 378 t statistics": float(t_err),
        "max error of the 28 half-widths (MAP@R)": float(ci_err),
        "max error of the 28 means (MAP@R)": float(max(abs(values[x].mean() - means[x]) for x in names)),
    }
    return values, checks


def restate(values: dict[str, np.ndarray]) -> str:
    group = best_group(values)
    leader = group.members[0].name
    m = group.family_size
    others = [x for x in values if x != BASELINE]
    p_base = [paired_t_test(values[x], values[BASELINE])[1] for x in others]
    base = dict(zip(others, zip(p_base, holm_adjust(p_base))))
    lines = [
        f"Method: {METHOD}; α = {group.alpha}, n = {group.n}, {m} ordered pairs.",
        "",
        f"| rank | loss | MAP@R ×100 | best group | adjusted p | gap to {leader} found with 80 % power "
        f"(corrected / uncorrected) | vs {BASELINE} (Holm over {len(others)}) |",
        "|---|---|---|---|---|---|---|",
    ]
    for rank, mem in enumerate(group.members, 1):
        x = values[mem.name]
        if mem.name == leader:
            gap = "–"
        else:
            sd = float(np.std(x - values[leader], ddof=1))
            corrected = paired_detectable_difference(sd, group.n, alpha=group.alpha / m, alternative="greater")
            plain = paired_detectable_difference(sd, group.n)
            gap = f"{100 * corrected:.1f} / {100 * plain:.2f}"
        if mem.name == BASELINE:
            vs = "—"
        else:
            p, p_holm = base[mem.name]
            diff = float(np.mean(x - values[BASELINE]))
            sd_b = float(np.std(x - values[BASELINE], ddof=1))
            if p_holm <= 0.05:
                vs = f"{'better' if diff > 0 else 'worse'} (p_Holm {p_holm:.3f})"
            else:
                below = paired_detectable_difference(sd_b, group.n, alpha=0.05 / len(others))
                vs = f"not distinguishable below {100 * below:.1f} points (p_Holm {p_holm:.2f})"
        verdict = "in" if mem.in_group else f"worse (beaten by {mem.beaten_by})"
        p_adj = "–" if math.isnan(mem.p_adjusted) else f"{mem.p_adjusted:.3f}"
        lines.append(f"| {rank} | {mem.name} | {100 * mem.mean:.2f} | {verdict} | {p_adj} | {gap} | {vs} |")
    lines += ["", f"Best group ({len(group.group)} of {len(values)}): {', '.join(group.group)}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="docs/results/omniglot-zoo/short-budget", type=Path)
    args = parser.parse_args()
    values, checks = rebuild(args.dir)
    print(restate(values))
    print()
    for name, v in checks.items():
        print(f"check: {name}: {v:.2e}")


if __name__ == "__main__":
    main()
