"""Where `make demo`'s sweep spends its time: wall time and CPU seconds by kind of process.

Runs ``dmlrc demo`` (the built-in preset, as ``make demo`` does) in a temporary folder, samples every process of its
tree twice a second (psutil: user + system CPU seconds of each pid, kept at its last reading, so processes that end
are counted too, from /proc), and prints:

* the sweep's wall time as the sweep prints it, and the command's;
* CPU seconds by kind: the fold worker processes (Ray workers that ran ``fold:…`` tasks), the trial drivers (Tune's
  ``ImplicitFunc`` actors), the sweep's driver, Ray's own processes (raylet, GCS, dashboard, agents, monitors);
* Σ of the folds' own ``cpu_seconds`` (``outcome.json``) and their numerics, i.e. the training inside the fold
  workers; the rest of the fold workers' CPU is their imports and per-fold bookkeeping.

With ``--set KEY=VALUE`` (repeatable; a dotted path into the preset, the value read as YAML) the same preset runs
with that field changed, e.g. ``--set resources.max_concurrent_studies=3`` or ``--set protocol.max_epochs=6``.

    python bench/demo_cost_bench.py [--set resources.max_concurrent_studies=3 ...]

Run it on an idle machine: every figure is CPU time of this run only, but the wall time depends on the load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


_TICK = os.sysconf("SC_CLK_TCK")


def _processes() -> dict[int, tuple[int, float, str]]:
    """Every process now: pid → (parent pid, user + system CPU seconds, command line)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, …; utime, stime at 11, 12
        out[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK, cmdline[:200])
    return out


def _kind(pid: int, title: str, driver_pid: int, seen: dict[int, str]) -> str:
    """The kind of a process of the demo's tree; a Ray worker that once ran a fold stays a fold worker."""
    if pid == driver_pid:
        return "sweep driver (dmlrc)"
    if "ray::fold:" in title or seen.get(pid) == "fold workers":
        return "fold workers"
    if "ImplicitFunc" in title or seen.get(pid) == "trial drivers (Tune actors)":
        return "trial drivers (Tune actors)"
    if "ray::" in title:
        return seen.get(pid, "other Ray workers (idle, agents)")
    if re.search(r"raylet|gcs_server|dashboard|log_monitor|monitor\.py|runtime_env", title):
        return "Ray's own processes"
    return seen.get(pid, "other")


def _sample(root: int, stop: threading.Event, cpu: dict[int, float], kinds: dict[int, str]) -> None:
    while not stop.is_set():
        procs = _processes()
        tree, frontier = {root}, {root}
        while frontier:
            frontier = {pid for pid, (ppid, _, _) in procs.items() if ppid in frontier} - tree
            tree |= frontier
        for pid in tree & procs.keys():
            _, seconds, title = procs[pid]
            cpu[pid] = seconds
            kinds[pid] = _kind(pid, title, root, kinds)
        stop.wait(0.5)


def _fold_cpu(storage: Path) -> tuple[int, float, set[str]]:
    n, total, numerics = 0, 0.0, set()
    for f in storage.rglob("outcome.json"):
        o = json.loads(f.read_text())
        n += 1
        total += float(o.get("cpu_seconds") or 0.0)
        numerics.add(str(o.get("numerics")))
    return n, total, numerics


def _override(doc: dict, assignment: str) -> None:
    """``a.b.c=VALUE``: doc["a"]["b"]["c"] = VALUE read as YAML."""
    key, sep, value = assignment.partition("=")
    if not sep:
        raise SystemExit(f"--set {assignment!r}: expected KEY=VALUE")
    *parents, leaf = key.split(".")
    node = doc
    for name in parents:
        node = node.setdefault(name, {})
    node[leaf] = yaml.safe_load(value)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="change a field of the preset")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="demo-cost-") as tmp:
        storage = Path(tmp) / "runs"
        if not args.set:
            cmd = [sys.executable, "-m", "pipelines.cli", "demo", "--storage", str(storage)]
        else:
            doc = yaml.safe_load((ROOT / "pipelines/config/demo.yaml").read_text())
            for assignment in args.set:
                _override(doc, assignment)
            doc["storage"] = str(storage)
            (Path(tmp) / "demo.yaml").write_text(yaml.safe_dump(doc))
            cmd = [sys.executable, "-m", "pipelines.cli", "sweep", str(Path(tmp) / "demo.yaml")]
        cpu: dict[int, float] = {}
        kinds: dict[int, str] = {}
        stop = threading.Event()
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        sampler = threading.Thread(target=_sample, args=(proc.pid, stop, cpu, kinds), daemon=True)
        sampler.start()
        out = proc.communicate()[0]
        wall = time.monotonic() - t0
        stop.set()
        sampler.join()
        if proc.returncode != 0:
            print(out[-3000:])
            return proc.returncode
        n, fold_cpu, numerics = _fold_cpu(storage)
    by_kind: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for pid, seconds in cpu.items():
        by_kind[kinds[pid]] += seconds
        count[kinds[pid]] += 1
    finished = re.search(r"finished in ([0-9.]+ min|[0-9.]+ s)", out)
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    print(f"CPU: {model}, {len(os.sched_getaffinity(0))} usable; load average at the end {os.getloadavg()}")
    print(f"sweep: finished in {finished.group(1) if finished else '?'} (as printed); command wall {wall:.1f} s")
    total = sum(by_kind.values())
    print(f"CPU seconds of the demo's processes: {total:.1f} ({total / wall:.2f} cores busy on average)")
    for kind, seconds in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<34} {seconds:7.1f} s  ({count[kind]} processes)")
    table = re.search(r"^dataset +loss .*?(?=^\s*$)", out, re.S | re.M)
    print(table.group(0) if table else "(no end-of-sweep table found)")
    print(
        f"folds: {n}, Σ cpu_seconds of their training {fold_cpu:.1f} s ({fold_cpu / max(n, 1):.2f} s per fold), "
        f"numerics {sorted(numerics)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
