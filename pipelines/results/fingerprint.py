"""The protocol fingerprint of a study: everything that must match for two studies' results to be compared.

Two studies are comparable — their rows may share a table, their reproductions a paired test — when they ran the same
protocol on the same data: the same dataset content, class split and folds; the same network (trunk, its pretrained
weights, embedding width, pooling, image size and transforms); the same training recipe and budget; the same search
(trials, sampler, start-up trials, pruning); the same reproduction count and seeds; the same metric code.  The loss and
its search space are what a comparison varies, so they are not in it.

A :class:`Fingerprint` holds those fields flat (``protocol.max_epochs``, ``model.trunk``, ...) with readable values, and
a hash of them; the sweep builds it from its config (:mod:`pipelines.execution.studies.fingerprints`). The sweep records
both on every study run (tags :data:`HASH_TAG` and :data:`FIELDS_TAG`, and a ``fingerprint.json`` artifact); ``dmlrc
report`` puts them in ``report.json`` and in the results bundle. Before a study is reused, or a bundle's studies join a
sweep, their fingerprint is compared with the config's (:func:`first_difference`): the first differing field is what a
refusal names.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Fingerprint",
    "first_difference",
    "shown_value",
    "fingerprint_of_tags",
    "fingerprint_tags",
    "HASH_TAG",
    "FIELDS_TAG",
    "ARTIFACT",
]

#: Study-run tags: the fingerprint's hash and its fields (compact JSON).
HASH_TAG = "dmlrc.fingerprint"
FIELDS_TAG = "dmlrc.fingerprint.fields"
#: The study-run artifact with the same content, indented.
ARTIFACT = "fingerprint.json"


@dataclass(frozen=True)
class Fingerprint:
    """Flat, readable fields and the first 16 hex digits of the sha256 of their canonical JSON."""

    fields: dict[str, Any]

    @property
    def hash(self) -> str:
        text = json.dumps(self.fields, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_json(self) -> dict[str, Any]:
        return {"hash": self.hash, "fields": dict(sorted(self.fields.items()))}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Fingerprint:
        return cls(dict(doc["fields"]))


def first_difference(expected: Fingerprint, found: Fingerprint) -> tuple[str, Any, Any] | None:
    """``(field, value in found, value in expected)`` of the first field (in sorted order) on which they differ, a
    field only one has included (its value there, ``"absent"`` in the other); None when they are equal."""
    for key in sorted(set(expected.fields) | set(found.fields)):
        a, b = found.fields.get(key, "absent"), expected.fields.get(key, "absent")
        if a != b:
            return key, a, b
    return None


def shown_value(v: Any) -> str:
    """A fingerprint field's value as an error line shows it: strings as they are, the rest as JSON, cut to 60
    characters."""
    text = v if isinstance(v, str) else json.dumps(v)
    return text if len(text) <= 60 else text[:57] + "..."


def fingerprint_tags(fp: Fingerprint) -> dict[str, str]:
    """The study run's tags for ``fp``."""
    return {HASH_TAG: fp.hash, FIELDS_TAG: json.dumps(fp.fields, sort_keys=True, separators=(",", ":"))}


def fingerprint_of_tags(tags: dict[str, str]) -> Fingerprint | None:
    """A study run's fingerprint read back from its tags; None for a run that predates fingerprints."""
    text = tags.get(FIELDS_TAG)
    return None if not text else Fingerprint(json.loads(text))
