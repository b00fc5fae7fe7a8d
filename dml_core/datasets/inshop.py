"""DeepFashion In-Shop Clothes Retrieval (Liu et al. 2016) from `list_eval_partition.txt`.

Layout: `<src>/Eval/list_eval_partition.txt` (or `<src>/list_eval_partition.txt`): line 1 = number of images,
line 2 = header `image_name item_id evaluation_status`, then one row per image, status in train/query/gallery.
Images (`img/WOMEN/.../id_00000001/02_1_front.jpg`) are looked up under `<src>/Img/` then `<src>/`.

Labels: MLRC does not cover In-Shop.  We use the rank of `item_id` among the sorted unique item ids
(0..7981 for the full set), so labels are contiguous; class name = item id.  `split` = evaluation_status.
Protocol: train items are trainval; the test is query vs gallery (`dataset_protocol("inshop", ...)`).
"""

from __future__ import annotations

from pathlib import Path

from dml_core.datasets._layout import check_files_exist, file_record, find_file, read_rows, to_int
from dml_core.shards import Record

NAME = "inshop"
EXPECTED = {"classes": 7982, "images": 52712}
LABEL_CONVENTION = "label = rank of item_id among the sorted unique item ids (0..7981)"
HEADER = ["image_name", "item_id", "evaluation_status"]
STATUSES = ("train", "query", "gallery")


def records(src: str | Path) -> list[Record]:
    src = Path(src)
    path = find_file(src, ["Eval/list_eval_partition.txt", "list_eval_partition.txt"], NAME)
    with open(path, encoding="utf-8") as f:
        first, header = f.readline().strip(), f.readline().split()
    declared = to_int(first, path, 1, "image count", NAME)
    if header != HEADER:
        raise ValueError(f"{NAME}: {path} line 2: expected header {' '.join(HEADER)!r}, got {' '.join(header)!r}")
    rows = read_rows(path, 3, skip=2, dataset=NAME)
    if len(rows) != declared:
        raise ValueError(f"{NAME}: {path}: line 1 declares {declared} images, the file lists {len(rows)}")
    for lineno, (_, _, status) in rows:
        if status not in STATUSES:
            raise ValueError(f"{NAME}: {path} line {lineno}: evaluation_status {status!r} not in {STATUSES}")
    item_status: dict[str, str] = {}
    for lineno, (_, item, status) in rows:
        kind = "train" if status == "train" else "test"
        if item_status.setdefault(item, kind) != kind:
            raise ValueError(f"{NAME}: {path} line {lineno}: item {item} is in both train and query/gallery")
    label = {item: i for i, item in enumerate(sorted(item_status))}
    first_image = rows[0][1][0]
    root = next((r for r in (src / "Img", src) if (r / first_image).is_file()), src / "Img")
    recs = [file_record(root, name, label[item], item, status) for _, (name, item, status) in rows]
    check_files_exist(root, recs, NAME)
    return recs
