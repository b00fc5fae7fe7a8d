"""Results bundles: a finished experiment's studies in one JSON file, to compare against without its MLflow store.

``dmlrc report`` writes ``results-bundle.json`` beside the report: per study, the per-reproduction test metrics with
their seeds, the study run's metrics (test intervals, cost, the untrained reference), the winning configuration, its
values on a bound, how its folds ended, and its protocol fingerprint (:mod:`pipelines.results.fingerprint`).  A sweep
config names bundles in ``compare_with`` (a local path or s3:// URI): their studies join the sweep's final table, the
report and the paired tests exactly as the experiment's own studies do, once their fingerprint matches the config's.

The file carries a format name, a schema version, the version of the package that wrote it and a sha256 checksum of
its content (canonical JSON of everything but the checksum): a file that is not a bundle, of another schema, from a
newer package or edited by hand is refused in one line naming the file.  ``created`` (optional: bundles written before
it lack it) is when ``dmlrc report`` wrote the file, ISO 8601 in UTC; a bundle's studies carry it as their
``source_date``, which every table that shows them names.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version  # pip's own version parser

from dml_core import __version__
from dml_core.storage import is_s3_uri, open_storage, read_errors
from pipelines.config.errors import ConfigError
from pipelines.config.fields import check_loss_name, check_name
from pipelines.config.redact import redact_credentials, redact_uri
from pipelines.config.uris import check_uri, special_file
from pipelines.results.bounds import BoundHit
from pipelines.results.fingerprint import Fingerprint, first_difference, shown_value
from pipelines.results.report_studies import Study

__all__ = [
    "BUNDLE_FILE",
    "SCHEMA_VERSION",
    "Bundle",
    "bundle_doc",
    "write_bundle",
    "read_bundle",
    "read_bundles",
    "comparable_studies",
]

BUNDLE_FILE = "results-bundle.json"
FORMAT = "dml-reality-check results bundle"
SCHEMA_VERSION = 1
#: Bundles above this size are not read (a results bundle of hundreds of studies is a few MB).
MAX_BYTES = 64 << 20


def _canonical(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def checksum(doc: dict[str, Any]) -> str:
    """``sha256:<hex>`` of the canonical JSON of ``doc`` without its ``checksum`` key."""
    return "sha256:" + hashlib.sha256(_canonical({k: v for k, v in doc.items() if k != "checksum"})).hexdigest()


def _package_version() -> str:
    return __version__  # the package's one version (pyproject reads it from there)


def _study_doc(s: Study) -> dict[str, Any]:
    return {
        "dataset": s.dataset,
        "loss": s.loss,
        "source_run_id": s.run_id,
        "sweep": s.sweep,
        "fingerprint": s.fingerprint.to_json() if s.fingerprint is not None else None,
        "metrics": dict(sorted(s.metrics.items())),
        "best_params": dict(s.best_params),
        "best_trial": s.best_trial,
        "on_bound": [{"param": h.param, "side": h.side, "bound": h.bound} for h in s.on_bound],
        "best_at_epoch_0": s.best_at_epoch_0,
        "training": dict(s.training),
        "reproductions": [
            {"index": i, "seed": s.seeds.get(i, ""), "test": dict(sorted(s.reproductions[i].items()))}
            for i in sorted(s.reproductions)
        ],
    }


def bundle_doc(experiment: str, studies: list[Study], created: str | None = None) -> dict[str, Any]:
    """The bundle of ``studies`` (those of ``experiment`` and any they were compared with), with its checksum;
    ``created`` (ISO 8601, UTC) when given."""
    doc: dict[str, Any] = {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "package_version": _package_version(),
        "experiment": experiment,
        **({"created": created} if created else {}),
        "studies": [_study_doc(s) for s in studies],
    }
    doc["checksum"] = checksum(doc)
    return doc


def write_bundle(experiment: str, studies: list[Study], path: str | Path) -> Path:
    """``results-bundle.json`` of ``studies`` at ``path``, created now."""
    path = Path(path)
    created = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    path.write_text(json.dumps(bundle_doc(experiment, studies, created), indent=1, sort_keys=True, allow_nan=True))
    return path


@dataclass
class Bundle:
    uri: str
    experiment: str
    studies: list[Study]

    @property
    def shown(self) -> str:
        return redact_uri(self.uri)


def _read_local(uri: str, field: str) -> bytes:
    """The bytes of a local bundle file (a folder: its ``results-bundle.json``): a device, FIFO or socket is refused
    by ``stat`` before it is opened (``/dev/zero`` has size 0 and never ends; opening a FIFO blocks), and at most
    :data:`MAX_BYTES` are read."""
    p = Path(uri).expanduser()
    if p.is_dir():
        p = p / BUNDLE_FILE
    what = special_file(p)
    if what is not None:
        raise ConfigError(field, f"{redact_uri(uri)} is {what}, not a results bundle (a regular file)")
    too_big = f"{redact_uri(uri)}: larger than {MAX_BYTES >> 20} MiB, not a results bundle"
    if p.stat().st_size > MAX_BYTES:
        raise ConfigError(field, too_big)
    # O_NONBLOCK: should the path have become a FIFO since the stat, the open returns instead of waiting
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(field, f"{redact_uri(uri)} is not a regular file, not a results bundle")
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise ConfigError(field, too_big)
    return data


def _read_bytes(uri: str, field: str) -> bytes:
    try:
        uri = check_uri(uri, field)  # a mistyped s3:// URI, another scheme, credentials in the URI: before any request
        if is_s3_uri(uri):
            parent, _, key = uri.rstrip("/").rpartition("/")
            data = open_storage(parent).get_bytes(key)
            if len(data) > MAX_BYTES:
                raise ConfigError(field, f"{redact_uri(uri)}: larger than {MAX_BYTES >> 20} MiB, not a results bundle")
        else:
            data = _read_local(uri, field)
    except ConfigError:
        raise
    except read_errors() as e:
        # the library's own words may quote the URI's user and password where redact_uri finds no pattern
        text = redact_credentials(" ".join(str(e).split()), uri)
        raise ConfigError(field, f"cannot read results bundle {redact_uri(uri)}: {text}") from None
    return data


def _version_tuple(v: str) -> tuple:
    try:
        return (Version(v),)
    except InvalidVersion:
        return ()


def _parse(uri: str, data: bytes, field: str) -> dict[str, Any]:
    where = redact_uri(uri)
    try:
        doc = json.loads(data.decode("utf-8"))
    except RecursionError:  # thousands of nested brackets: json's scanner gives up on the depth
        raise ConfigError(field, f"{where} is not a results bundle (JSON nested too deeply)") from None
    except ValueError as e:  # not UTF-8, not JSON (both ValueErrors)
        raise ConfigError(
            field, f"{where} is not a results bundle (not JSON: {' '.join(str(e).split())[:200]})"
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ConfigError(field, f"{where} is not a results bundle (no format {FORMAT!r}); `dmlrc report` writes one")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise ConfigError(
            field,
            f"{where}: results-bundle schema version {doc.get('schema_version')!r}; this dml-reality-check reads "
            f"version {SCHEMA_VERSION}",
        )
    wrote, ours = str(doc.get("package_version", "")), _package_version()
    if _version_tuple(wrote) and _version_tuple(wrote) > _version_tuple(ours):
        raise ConfigError(
            field,
            f"{where} was written by dml-reality-check {wrote}, newer than this {ours}: upgrade to read it",
        )
    try:
        stamped = checksum(doc)
    except (RecursionError, ValueError):  # nested deeper than JSON can be written back
        raise ConfigError(field, f"{where} is not a results bundle (JSON nested too deeply)") from None
    if doc.get("checksum") != stamped:
        raise ConfigError(
            field, f"{where}: checksum mismatch — the file was changed after `dmlrc report` wrote it; use the original"
        )
    return doc


def _study(entry: dict[str, Any], uri: str, created: str = "") -> Study:
    fp = entry.get("fingerprint")
    reps = {int(r["index"]): {k: float(v) for k, v in r["test"].items()} for r in entry["reproductions"]}
    return Study(
        run_id=str(entry.get("source_run_id", "")),
        dataset=str(entry["dataset"]),
        loss=str(entry["loss"]),
        metrics={k: float(v) for k, v in entry["metrics"].items()},
        reproductions=reps,
        seeds={int(r["index"]): str(r.get("seed", "")) for r in entry["reproductions"]},
        best_params={str(k): str(v) for k, v in entry.get("best_params", {}).items()},
        best_trial=str(entry.get("best_trial", "")),
        sweep=str(entry.get("sweep", "")),
        training=dict(entry.get("training", {})),  # counts stay integers, as collect_studies gives them
        best_at_epoch_0=bool(entry.get("best_at_epoch_0", False)),
        untrained={k[len("untrained.") :]: v for k, v in entry["metrics"].items() if k.startswith("untrained.")},
        on_bound=[BoundHit(h["param"], h["side"], float(h["bound"])) for h in entry.get("on_bound", [])],
        fingerprint=Fingerprint.from_json(fp) if fp else None,
        source=f"bundle {redact_uri(uri)}",
        source_date=created,
    )


#: Control characters (C0, DEL, C1): a terminal escape sequence or a line break in a bundle's text would reach the
#: terminal and report.md raw (a forged table row).
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _control_character(value: Any, path: str) -> str | None:
    """The path (``best_params.margin``) of the first string, key or value, in ``value`` holding a control
    character, or None."""
    if isinstance(value, str):
        return path if _CONTROL_RE.search(value) else None
    if isinstance(value, dict):
        for k, v in value.items():
            here = f"{path}.{k}" if path else str(k)
            if _CONTROL_RE.search(str(k)):
                return here
            found = _control_character(v, here)
            if found:
                return found
    if isinstance(value, list):
        for i, v in enumerate(value):
            found = _control_character(v, f"{path}[{i}]")
            if found:
                return found
    return None


def _stated_reproductions(s: Study) -> tuple[int, str] | None:
    """How many reproductions ``s`` says it has and where it says so: the count its interval was computed from
    (``test.n_reproductions``), else its fingerprint's (``protocol.reproductions``, the reproduction seeds)."""
    if "test.n_reproductions" in s.metrics:
        return int(s.metrics["test.n_reproductions"]), "its metric test.n_reproductions"
    fields = s.fingerprint.fields if s.fingerprint is not None else {}
    if isinstance(fields.get("protocol.reproductions"), int):
        return fields["protocol.reproductions"], "its fingerprint's protocol.reproductions"
    if isinstance(fields.get("reproduction.seeds"), list):
        return len(fields["reproduction.seeds"]), "its fingerprint's reproduction.seeds"
    return None


def _check_study(entry: dict[str, Any], s: Study, i: int) -> str | None:
    """What is wrong with study ``i`` of a bundle that its checksum cannot tell (the file may have been edited and
    stamped again): a name that is not a dataset or loss name, a control character in any text, a metric that is
    not finite, reproductions other than it states.  None when nothing is."""
    for what, check, value in (("dataset", check_name, s.dataset), ("loss", check_loss_name, s.loss)):
        try:
            check(value)
        except ValueError as e:
            return f"study {i}: {what} {e}"
    study = f"study {s.loss!r} on {s.dataset!r}"
    where = _control_character(entry, "")
    if where:
        return f"{study}: {where} holds a control character (a line break or terminal escape)"
    values = [(f"metrics.{k}", v) for k, v in s.metrics.items()]
    values += [(f"reproductions[{r}].{k}", v) for r, test in s.reproductions.items() for k, v in test.items()]
    values += [(f"on_bound.{h.param}.bound", h.bound) for h in s.on_bound]
    for name, v in values:
        if not math.isfinite(v):
            return f"{study}: {name} is {v} (a finished study's metrics are finite)"
    stated = _stated_reproductions(s)
    held = sum(1 for test in s.reproductions.values() if test)  # a failed reproduction's run holds no test metric
    if stated is not None and stated[0] != held:
        return (
            f"{study}: {held} reproductions with test metrics, but {stated[1]} says {stated[0]} (its interval is "
            "not computed from the reproductions it holds)"
        )
    seeds = s.fingerprint.fields.get("reproduction.seeds") if s.fingerprint is not None else None
    if isinstance(seeds, list):
        allowed = {str(x) for x in seeds}
        strange = sorted({x for x in s.seeds.values() if x and x not in allowed})
        if strange:
            return f"{study}: reproduction seed {strange[0]} is not one of its fingerprint's reproduction.seeds"
    return None


def _created(doc: dict[str, Any], uri: str, field: str) -> str:
    """The bundle's ``created`` time as written ("" for a bundle without one); a value that is not an ISO 8601 time
    (it reaches the terminal and every report) is refused."""
    created = doc.get("created", "")
    if created == "":
        return ""
    try:
        if not isinstance(created, str) or _CONTROL_RE.search(created) or len(created) > 40:
            raise ValueError
        datetime.fromisoformat(created.replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(
            field, f"{redact_uri(uri)}: created is not an ISO 8601 time (as `dmlrc report` writes it)"
        ) from None
    return created


def read_bundle(uri: str, field: str = "compare_with") -> Bundle:
    """The bundle at ``uri`` (a file, a folder holding ``results-bundle.json``, or s3://), checked; any problem is
    one :class:`ConfigError` on ``field``."""
    doc = _parse(uri, _read_bytes(uri, field), field)
    created = _created(doc, uri, field)
    try:
        entries = doc["studies"]
        studies = [_study(e, uri, created) for e in entries]
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        text = _CONTROL_RE.sub(lambda m: repr(m.group())[1:-1], " ".join(str(e).split()))[:200]
        raise ConfigError(
            field, f"{redact_uri(uri)}: a study entry is malformed ({type(e).__name__}: {text})"
        ) from None
    for i, (entry, s) in enumerate(zip(entries, studies)):
        problem = _check_study(entry, s, i)
        if problem:
            raise ConfigError(field, f"{redact_uri(uri)}: {problem}")
    seen: dict[tuple[str, str], int] = {}
    for i, s in enumerate(studies):
        if (s.dataset, s.loss) in seen:
            raise ConfigError(
                field,
                f"{redact_uri(uri)}: studies {seen[(s.dataset, s.loss)]} and {i} are both {s.loss!r} on {s.dataset!r}",
            )
        seen[(s.dataset, s.loss)] = i
    return Bundle(uri, str(doc.get("experiment", "")), studies)


def read_bundles(uris: list[str], field: str = "compare_with") -> list[Bundle]:
    """Every bundle of ``uris``; the same (dataset, loss) in two of them is refused."""
    bundles = [read_bundle(u, f"{field}[{i}]" if len(uris) > 1 else field) for i, u in enumerate(uris)]
    owner: dict[tuple[str, str], Bundle] = {}
    for b in bundles:
        for s in b.studies:
            other = owner.get((s.dataset, s.loss))
            if other is not None:
                raise ConfigError(
                    field,
                    f"two studies of loss {s.loss!r} on {s.dataset!r}: in {other.shown} and in {b.shown}; keep one",
                )
            owner[(s.dataset, s.loss)] = b
    return bundles


_CONTENT = "dataset.content_sha256"


def _warn_renamed(
    b: Bundle, field: str, datasets: Collection[str], expected: Callable[[str, str], Fingerprint | None]
) -> None:
    """One warning line per dataset of ``b`` that holds the same data as one of ``datasets`` under another name."""
    warned = set()
    for s in b.studies:
        theirs = s.fingerprint.fields.get(_CONTENT) if s.fingerprint is not None else None
        if s.dataset in datasets or theirs is None or s.dataset in warned:
            continue
        for d in sorted(datasets):
            ours = expected(d, s.loss)
            if ours is not None and ours.fields.get(_CONTENT) == theirs:
                warned.add(s.dataset)
                n = sum(1 for t in b.studies if t.dataset == s.dataset)
                left = f"{n} study is" if n == 1 else f"{n} studies are"
                print(
                    f"warning: {field}: {b.shown}: its dataset {s.dataset!r} holds the same data as dataset {d!r} here "
                    f"({_CONTENT} equal) under another name, so its {left} left out; name the dataset "
                    f"{s.dataset!r} to compare with them",
                    file=sys.stderr,
                    flush=True,
                )
                break


def comparable_studies(
    bundles: list[Bundle],
    field: str,
    datasets: Collection[str],
    expected: Callable[[str, str], Fingerprint | None],
    held: Mapping[tuple[str, str], str],
) -> list[Study]:
    """The studies of ``bundles`` on ``datasets`` that may join a table beside the studies of one's own, which the
    sweep (pipelines.execution.studies.reuse) and the report (pipelines.results.report) both admit by these rules:

    * a (dataset, loss) that ``held`` already names (→ where that study is) is refused: two studies of one loss;
    * a study must carry the fingerprint ``expected(dataset, loss)`` gives; one without a fingerprint, or one whose
      first differing field differs, is refused naming that field and both values.

    A bundle's study on a dataset name that ``datasets`` lacks is left out; when its fingerprint records the same
    data (``dataset.content_sha256``) as one of ``datasets``, one ``warning:`` line per (bundle, dataset) says so,
    naming both names (the same images under another name compare with nothing).

    Each refusal is one :class:`ConfigError` on ``field``."""
    admitted = []
    for b in bundles:
        _warn_renamed(b, field, datasets, expected)
        for s in b.studies:
            if s.dataset not in datasets:
                continue  # a dataset of the bundle that this table does not have
            if (s.dataset, s.loss) in held:
                raise ConfigError(
                    field,
                    f"two studies of loss {s.loss!r} on {s.dataset!r}: {held[(s.dataset, s.loss)]} and {b.shown}; "
                    "compare in another experiment, or drop the bundle",
                )
            ours = expected(s.dataset, s.loss)
            if s.fingerprint is None or ours is None:
                why = "one of the two records no protocol fingerprint"
            else:
                diff = first_difference(ours, s.fingerprint)
                if diff is None:
                    admitted.append(s)
                    continue
                why = f"{diff[0]}: {shown_value(diff[1])} vs {shown_value(diff[2])}"
            raise ConfigError(
                field,
                f"{b.shown}: study {s.loss!r} on {s.dataset!r} is not comparable ({why}, the bundle's value first); "
                "run the bundle's protocol, or drop the bundle",
            )
    return admitted
