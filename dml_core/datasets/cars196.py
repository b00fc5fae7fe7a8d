"""Stanford Cars-196 (Krause et al. 2013) from `cars_annos.mat` + `car_ims/`.

Layout: `<src>/cars_annos.mat` and `<src>/car_ims/*.jpg`.  The .mat struct array `annotations` has fields
`relative_im_path` (`car_ims/000001.jpg`), `bbox_*`, `class` (1..196) and `test` (0/1); `class_names` names
the classes.  Read with `scipy.io.loadmat`.

Labels (docs/protocol.md §Datasets): MLRC uses every entry (official train and test halves merged) with the .mat class
ids **1..196 as labels** (its class split: 1..98 trainval, 99..196 test).  We keep 1..196; a consumer that needs
0-based ids must remap (the class split works on sorted ids either way).  `split` = `train` / `test` from the
`test` field.  Class name = `class_names[class - 1]` when present, else `class_<id>`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dml_core.datasets._layout import check_files_exist, file_record, find_file
from dml_core.shards import LayoutError, Record

NAME = "cars196"
EXPECTED = {"classes": 196, "images": 16185}
LABEL_CONVENTION = "label = cars_annos.mat class id (1..196), official train+test merged (MLRC)"


def _scalar(x):
    """Unwrap loadmat's nested 1x1 arrays (with or without squeeze_me) to a Python scalar / str."""
    while isinstance(x, np.ndarray):
        if x.size != 1:
            raise ValueError(f"expected a scalar, got an array of shape {x.shape}")
        x = x.reshape(-1)[0]
    return x.item() if isinstance(x, np.generic) else x


def records(src: str | Path) -> list[Record]:
    # scipy (seconds to import): only Cars196's annotations are a .mat file
    from scipy.io import loadmat

    src = Path(src)
    mat_path = find_file(src, ["cars_annos.mat"], NAME)
    try:
        mat = loadmat(mat_path, squeeze_me=True)
    except Exception as e:  # scipy raises ValueError, MatReadError, TypeError ... for a damaged file
        raise LayoutError(f"{mat_path}: {NAME}: not a readable .mat file ({type(e).__name__}: {e})") from None
    if "annotations" not in mat:
        found = sorted(k for k in mat if not k.startswith("__"))
        raise LayoutError(f"{mat_path}: {NAME}: has no 'annotations' variable (found {found})")
    ann = np.atleast_1d(mat["annotations"])
    fields = ann.dtype.names or ()
    for f in ("relative_im_path", "class", "test"):
        if f not in fields:
            raise LayoutError(f"{mat_path}: {NAME}: annotations lack field {f!r} (fields: {fields})")
    names = None
    if "class_names" in mat:
        names = [str(_scalar(n)) for n in np.atleast_1d(mat["class_names"]).reshape(-1)]
        seen: dict[str, int] = {}
        for i, n in enumerate(names, start=1):
            if n in seen:
                raise LayoutError(f"{mat_path}: {NAME}: classes {seen[n]} and {i} have the same class name {n!r}")
            seen[n] = i

    recs = []
    for i, a in enumerate(ann):
        try:
            path = str(_scalar(a["relative_im_path"]))
            cls = int(_scalar(a["class"]))
            test = int(_scalar(a["test"]))
        except (ValueError, TypeError) as e:
            raise LayoutError(f"{mat_path}: {NAME}: annotations[{i}] is malformed: {e}") from None
        if cls < 1 or (names is not None and cls > len(names)):
            top = len(names) if names is not None else "?"
            raise LayoutError(f"{mat_path}: {NAME}: annotations[{i}] ({path}) has class {cls} outside 1..{top}")
        if test not in (0, 1):
            raise LayoutError(f"{mat_path}: {NAME}: annotations[{i}] ({path}) has test={test} (expected 0 or 1)")
        name = names[cls - 1] if names is not None else f"class_{cls:03d}"
        recs.append(
            file_record(src, path, cls, name, "test" if test else "train", where=f"{mat_path}: annotations[{i}]")
        )
    if not recs:
        raise LayoutError(f"{mat_path}: {NAME}: no annotations")
    check_files_exist(src, recs, NAME)
    return recs
