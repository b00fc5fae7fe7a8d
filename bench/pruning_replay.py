"""Pruning rules replayed on recorded searches (pipelines/records/replay.py): per rule, the CPU it would have saved
and whether each study's search keeps its winner (the same trial, or one within 0.03 val MAP@R).

    .venv/bin/python bench/pruning_replay.py docs/results/omniglot-zoo/studies [--json out.json]

Only studies whose search is completely recorded and unpruned take part (their curves are whole)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipelines.records.replay import choose_rule, default_rules, max_t_of, replay_all  # noqa: E402
from pipelines.records.report import read_records  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    studies = []
    for rs in read_records(args.records):
        trials = rs.records.trials
        if len(trials) < rs.header.trials or any(t.status == "pruned" for t in trials):
            print(f"skipped {rs.header.study}: {len(trials)}/{rs.header.trials} trials recorded")
            continue
        studies.append((rs.header.study, trials, max_t_of(rs.header)))
    if not studies:
        print("no complete unpruned search in the records")
        return 1
    results = replay_all(studies, default_rules())
    print(f"{len(studies)} studies: {', '.join(s for s, _, _ in studies)}")
    print(f"{'rule':<24} {'CPU saved':>10} {'pruned':>7} {'winners kept':>13}  lost (gap)")
    for rule, reps in results.items():
        total = sum(r.cpu_seconds for r in reps)
        saved = sum(r.cpu_saved for r in reps)
        lost = ", ".join(f"{r.study} ({r.gap:.3f})" for r in reps if not r.kept)
        print(
            f"{rule.name:<24} {100 * saved / total if total else 0:>9.1f}% {sum(r.pruned for r in reps):>7} "
            f"{sum(r.kept for r in reps):>6}/{len(reps):<6}  {lost or '-'}"
        )
    best = choose_rule(results)
    print(f"chosen: {best.name if best else 'none kept every winner: run unpruned'}")
    if args.json:
        doc = {"rules": {r.name: [x.as_json() for x in reps] for r, reps in results.items()}}
        doc["chosen"] = best.name if best else None
        Path(args.json).write_text(json.dumps(doc, indent=2, allow_nan=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
