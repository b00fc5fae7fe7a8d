"""Stanford Online Products (Oh Song et al. 2016) from `Ebay_train.txt` / `Ebay_test.txt`.

Layout: `<src>/Ebay_train.txt`, `<src>/Ebay_test.txt` (header `image_id class_id super_class_id path`, paths like
`bicycle_final/111085122871_0.JPG` relative to `<src>`).

Labels (docs/protocol.md §Datasets): MLRC concatenates both files and uses `class_id - 1` (0..22633).  `split` = the
file a row came from (`train` / `test`): the official split has train classes 0..11317 (11,318 classes), while
MLRC's sorted-halves split puts 0..11316 in trainval — one class off (docs/protocol.md §Class split).
Which one a sweep uses is `dataset_protocol(..., sop_split="mlrc" | "official")`.  Class name =
`<super-class dir>/<class_id>`.
"""

from __future__ import annotations

from pathlib import Path

from dml_core.datasets._layout import check_files_exist, file_record, find_file, read_rows, to_int
from dml_core.shards import LayoutError, Record

NAME = "sop"
EXPECTED = {"classes": 22634, "images": 120053}
LABEL_CONVENTION = "label = class_id - 1 (0..22633), Ebay_train.txt + Ebay_test.txt merged (MLRC)"
HEADER = ["image_id", "class_id", "super_class_id", "path"]


def records(src: str | Path) -> list[Record]:
    src = Path(src)
    recs = []
    class_split: dict[int, str] = {}
    for split in ("train", "test"):
        path = find_file(src, [f"Ebay_{split}.txt"], NAME)
        try:
            with open(path, encoding="utf-8") as f:
                header = f.readline().split()
        except UnicodeDecodeError as e:
            raise LayoutError(f"{path}: {NAME}: not UTF-8 text ({e})") from None
        if header != HEADER:
            raise LayoutError(f"{path} line 1: {NAME}: expected header {' '.join(HEADER)!r}, got {' '.join(header)!r}")
        for lineno, (_, class_id, _, rel) in read_rows(path, 4, skip=1, dataset=NAME):
            c = to_int(class_id, path, lineno, "class_id", NAME)
            if c < 1:
                raise LayoutError(f"{path} line {lineno}: {NAME}: class_id {c} (expected >= 1)")
            if class_split.setdefault(c, split) != split:
                raise LayoutError(
                    f"{path} line {lineno}: {NAME}: class_id {c} is in both Ebay_train.txt and Ebay_test.txt"
                )
            recs.append(file_record(src, rel, c - 1, f"{rel.split('/')[0]}/{c}", split, where=f"{path} line {lineno}"))
    check_files_exist(src, recs, NAME)
    return recs
