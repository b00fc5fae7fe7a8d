"""Omniglot (Lake et al. 2015) from its `images_*.zip` files (here the two `images_background_small*.zip`).

Each zip holds `<zip root>/<alphabet>/<character>/<drawer file>.png` (105x105 1-bit PNG).  Class =
"alphabet/character"; labels 0..C-1 in sorted class-name order.  The two small background zips share Greek
and Latin (identical files): they are written once (`dml_core.data.iter_omniglot` checks the bytes agree).
Result: 8 alphabets, 242 characters × 20 drawers = 4,840 images.  `split` = `background` (the zips' set).
"""

from __future__ import annotations

from pathlib import Path

from dml_core.data import iter_omniglot
from dml_core.shards import Record

NAME = "omniglot"
EXPECTED = {"classes": 242, "images": 4840}  # the two images_background_small zips
LABEL_CONVENTION = "label = index of 'alphabet/character' in sorted order (0..C-1)"


def _const(data: bytes):
    return lambda: data


def records(src: str | Path) -> list[Record]:
    # The zips total ~3 MB, so holding the PNG bytes while sorting is fine (unlike the photo datasets).
    rows = sorted(iter_omniglot(src))
    names = sorted({"/".join(rel.split("/")[:2]) for rel, _, _ in rows})
    index = {n: i for i, n in enumerate(names)}
    out = []
    for rel, data, _ in rows:
        cls = "/".join(rel.split("/")[:2])
        out.append(Record(relpath=rel, label=index[cls], class_name=cls, split="background", read=_const(data)))
    return out
