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

from dml_core.datasets._layout import check_files_exist, check_relpath, file_record, find_file, read_rows, to_int
from dml_core.shards import LayoutError, Record

NAME = "inshop"
EXPECTED = {"classes": 7982, "images": 52712}
LABEL_CONVENTION = "label = rank of item_id among the sorted unique item ids (0..7981)"
HEADER = ["image_name", "item_id", "evaluation_status"]
STATUSES = ("train", "query", "gallery")


def records(src: str | Path) -> list[Record]:
    src = Path(src)
    path = find_file(src, ["Eval/list_eval_partition.txt", "list_eval_partition.txt"], NAME)
    try:
        with open(path, encoding="utf-8") as f:
            first, header = f.readline().strip(), f.readline().split()
    except UnicodeDecodeError as e:
        raise LayoutError(f"{path}: {NAME}: not UTF-8 text ({e})") from None
    declared = to_int(first, path, 1, "image count", NAME)
    if header != HEADER:
        raise LayoutError(f"{path} line 2: {NAME}: expected header {' '.join(HEADER)!r}, got {' '.join(header)!r}")
    rows = read_rows(path, 3, skip=2, dataset=NAME)
    if len(rows) != declared:
        raise LayoutError(f"{path}: {NAME}: line 1 declares {declared} images, the file lists {len(rows)}")
    for lineno, (_, _, status) in rows:
        if status not in STATUSES:
            raise LayoutError(f"{path} line {lineno}: {NAME}: evaluation_status {status!r} not in {STATUSES}")
    item_status: dict[str, str] = {}
    for lineno, (_, item, status) in rows:
        kind = "train" if status == "train" else "test"
        if item_status.setdefault(item, kind) != kind:
            raise LayoutError(f"{path} line {lineno}: {NAME}: item {item} is in both train and query/gallery")
    label = {item: i for i, item in enumerate(sorted(item_status))}
    first_image = check_relpath(rows[0][1][0], f"{path} line {rows[0][0]}")
    root = next((r for r in (src / "Img", src) if (r / first_image).is_file()), src / "Img")
    recs = [
        file_record(root, name, label[item], item, status, where=f"{path} line {lineno}")
        for lineno, (name, item, status) in rows
    ]
    check_files_exist(root, recs, NAME)
    return recs
