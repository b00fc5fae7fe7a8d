"""Omniglot (Lake et al. 2015) from its `images_*.zip` files (here the two `images_background_small*.zip`).

Each zip holds `<zip root>/<alphabet>/<character>/<drawer file>.png` (105x105 1-bit PNG).  Class =
"alphabet/character"; labels 0..C-1 in sorted class-name order.  The two small background zips share Greek
and Latin (identical files): they are written once (`iter_zips` checks the bytes agree).
Result: 8 alphabets, 242 characters × 20 drawers = 4,840 images.  `split` = `background` (the zips' set).

Zip entries are untrusted input: an entry name with `..`, an absolute name, a drive or a backslash is rejected
(it would otherwise become a class such as "../.."), and a damaged zip or member (bad CRC, truncated file) is a
`LayoutError` naming the zip (and member).
"""

from __future__ import annotations

import hashlib
import os
import zipfile
import zlib
from pathlib import Path, PurePosixPath

from dml_core.shards import DataFileNotFoundError, LayoutError, Record

NAME = "omniglot"
EXPECTED = {"classes": 242, "images": 4840}  # the two images_background_small zips
LABEL_CONVENTION = "label = index of 'alphabet/character' in sorted order (0..C-1)"


def _check_entry(zpath: Path, name: str) -> None:
    if name.startswith("/") or "\\" in name or PurePosixPath(name).is_absolute() or (len(name) > 1 and name[1] == ":"):
        raise LayoutError(f"{zpath}: entry {name!r} is an absolute path or has a drive/backslash (rejected)")
    if ".." in name.split("/"):
        raise LayoutError(f"{zpath}: entry {name!r} contains '..' (rejected: it would leave the zip's root)")


def iter_zips(zip_dir: str | os.PathLike):
    """Yield (relpath 'Alphabet/characterNN/file.png', png bytes, source zip path), deduplicated across zips.

    The two `images_background_small*.zip` files both contain Greek and Latin with identical files; a relpath
    seen twice must have identical bytes (else LayoutError naming both zips)."""
    zip_dir = Path(zip_dir)
    zips = sorted(zip_dir.glob("images_*.zip"))
    if not zips:
        raise DataFileNotFoundError(f"{zip_dir}: no Omniglot images_*.zip files")
    seen: dict[str, tuple[str, str]] = {}
    for zpath in zips:
        try:
            zf = zipfile.ZipFile(zpath)
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise LayoutError(f"{zpath}: not a readable zip file ({e})") from None
        with zf:
            names = zf.namelist()
            for name in names:  # every entry, before anything is read: a bad name rejects the whole zip
                _check_entry(zpath, name)
            for name in sorted(names):
                parts = name.split("/")
                # <zip root>/<alphabet>/<character>/<file>.png; skip directories and OS litter
                if len(parts) != 4 or not parts[3].lower().endswith(".png") or parts[0].startswith("__MACOSX"):
                    continue
                if not all(parts):
                    raise LayoutError(f"{zpath}: entry {name!r} has an empty path component")
                rel = "/".join(parts[1:])
                try:
                    data = zf.read(name)
                except (zipfile.BadZipFile, zlib.error, EOFError, OSError, NotImplementedError) as e:
                    raise LayoutError(f"{zpath}: {name}: cannot be read from the zip ({e})") from None
                except RuntimeError as e:  # zipfile's "File ... is encrypted, password required for extraction"
                    raise LayoutError(
                        f"{zpath}: {name}: encrypted in the zip (the Omniglot zips are not): {' '.join(str(e).split())}"
                    ) from None
                digest = hashlib.sha256(data).hexdigest()
                if rel in seen:
                    if seen[rel][1] != digest:
                        raise LayoutError(f"{zpath}: {rel} differs between {seen[rel][0]} and {zpath.name}")
                    continue
                seen[rel] = (zpath.name, digest)
                yield rel, data, f"{zpath}: {name}"


def _const(data: bytes):
    return lambda: data


def records(src: str | Path) -> list[Record]:
    # The zips total ~3 MB, so holding the PNG bytes while sorting is fine (unlike the photo datasets).
    rows = sorted(iter_zips(src))
    names = sorted({"/".join(rel.split("/")[:2]) for rel, _, _ in rows})
    index = {n: i for i, n in enumerate(names)}
    out = []
    for rel, data, source in rows:
        cls = "/".join(rel.split("/")[:2])
        out.append(
            Record(relpath=rel, label=index[cls], class_name=cls, split="background", read=_const(data), source=source)
        )
    return out
