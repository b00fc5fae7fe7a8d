"""CUB-200-2011 (Wah et al. 2011) from its official layout.

Layout: `<src>/CUB_200_2011/` (or `<src>` itself) with `images.txt` (`<image_id> <class_dir>/<file>.jpg`),
`image_class_labels.txt` (`<image_id> <class_id 1..200>`), `train_test_split.txt` (`<image_id> <is_training>`)
and the images under `images/`.

Labels (docs/protocol.md §Datasets): MLRC reads CUB with torchvision `ImageFolder` over `images/`, so labels are the
class directories' sorted order 0..199.  The directories are named `001.Black_footed_Albatross` ... so that
order equals `class_id - 1`; we use `class_id - 1` and check it agrees with the directory order.
Class name = the class directory.  `split` = the official image-level split (`train` / `test`); the protocol
does not use it (MLRC splits by class: 0..99 trainval, 100..199 test).
"""

from __future__ import annotations

from pathlib import Path

from dml_core.datasets._layout import check_files_exist, file_record, find_file, read_rows, to_int
from dml_core.shards import LayoutError, Record

NAME = "cub200"
EXPECTED = {"classes": 200, "images": 11788}
LABEL_CONVENTION = "label = class_id - 1 (0..199) = torchvision ImageFolder order of images/<class dir> (MLRC)"


def _id_table(path: Path) -> dict[int, tuple[int, str]]:
    """image_id -> (line number, second field) of a two-column listing; an id listed twice is an error."""
    out: dict[int, tuple[int, str]] = {}
    for lineno, (image_id, value) in read_rows(path, 2, dataset=NAME):
        i = to_int(image_id, path, lineno, "image_id", NAME)
        if i in out:
            raise LayoutError(f"{path} line {lineno}: {NAME}: image_id {i} is listed twice (first on line {out[i][0]})")
        out[i] = (lineno, value)
    return out


def records(src: str | Path) -> list[Record]:
    src = Path(src)
    root = src / "CUB_200_2011" if (src / "CUB_200_2011").is_dir() else src
    images_txt = find_file(root, ["images.txt"], NAME)
    labels_txt = find_file(root, ["image_class_labels.txt"], NAME)
    split_txt = find_file(root, ["train_test_split.txt"], NAME)

    paths = _id_table(images_txt)
    class_ids = {i: to_int(c, labels_txt, n, "class_id", NAME) for i, (n, c) in _id_table(labels_txt).items()}
    split_lines = _id_table(split_txt)
    is_train = {i: to_int(t, split_txt, n, "is_training_image", NAME) for i, (n, t) in split_lines.items()}
    for listing, table in ((labels_txt, class_ids), (split_txt, is_train)):
        if set(table) != set(paths):
            diff = sorted(set(table) ^ set(paths))[:10]
            raise LayoutError(f"{listing}: {NAME}: image ids differ from those of images.txt, e.g. {diff}")

    class_dir: dict[int, str] = {}
    for image_id, (lineno, path) in paths.items():
        if "/" not in path:
            raise LayoutError(
                f"{images_txt} line {lineno}: {NAME}: image {image_id} path {path!r} has no class directory"
            )
        c = class_ids[image_id]
        if c < 1:
            raise LayoutError(f"{labels_txt}: {NAME}: image {image_id} has class_id {c} (expected >= 1)")
        d = path.split("/")[0]
        if class_dir.setdefault(c, d) != d:
            raise LayoutError(
                f"{images_txt} line {lineno}: {NAME}: class_id {c} spans two directories, {class_dir[c]!r} and {d!r}"
            )
    folder_order = {d: i for i, d in enumerate(sorted(set(class_dir.values())))}
    mismatched = [(c, d) for c, d in class_dir.items() if folder_order[d] != c - 1]
    if mismatched:
        raise LayoutError(
            f"{labels_txt}: {NAME}: class_id - 1 differs from the ImageFolder (sorted directory) "
            f"order for {sorted(mismatched)[:5]}; the MLRC label convention would be ambiguous"
        )
    for image_id, t in is_train.items():
        if t not in (0, 1):
            raise LayoutError(
                f"{split_txt} line {split_lines[image_id][0]}: {NAME}: image {image_id} has "
                f"is_training_image {t} (expected 0 or 1)"
            )

    recs = [
        file_record(
            root,
            f"images/{paths[i][1]}",
            class_ids[i] - 1,
            class_dir[class_ids[i]],
            "train" if is_train[i] else "test",
            where=f"{images_txt} line {paths[i][0]}",
        )
        for i in sorted(paths)
    ]
    check_files_exist(root, recs, NAME)
    return recs
