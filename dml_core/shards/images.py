"""Checks of one encoded image: its header only (`image_header`, the cheap preflight) or a full decode
(`check_image`, what `write_shards` and `verify_shards` run)."""

from __future__ import annotations

import io
from typing import cast

from PIL import Image, ImageFile, UnidentifiedImageError

from dml_core.shards.errors import CorruptImageError

__all__ = ["check_image", "image_header"]

_IEND_CRC = bytes.fromhex("ae426082")  # crc32(b"IEND"), the same in every PNG


def image_header(data: bytes, where: str) -> tuple[str, int, int]:
    """(format, width, height) from the header only (magic bytes + dimensions); CorruptImageError if unreadable."""
    if not data:
        raise CorruptImageError(f"{where}: empty image")
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt, (w, h) = im.format, im.size
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise CorruptImageError(f"{where}: not a readable image ({e})") from e
    if w < 1 or h < 1:
        raise CorruptImageError(f"{where}: {fmt} image of size {w}x{h}")
    return cast(str, fmt), w, h  # Image.open sets the format of the plugin that read the file: never None


def check_image(data: bytes, where: str) -> tuple[str, int, int]:
    """Fully check one encoded image: the header, then every PNG chunk's CRC (`Image.verify`), then a complete
    decode (a truncated file fails: Pillow refuses truncated images unless ImageFile.LOAD_TRUNCATED_IMAGES is
    set, which this refuses to run under).  Returns (format, width, height).

    JPEG has no checksum: a flipped bit inside the entropy-coded data usually decodes to slightly different
    pixels and cannot be detected by any decoder; flipped markers, headers and truncation are caught."""
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise RuntimeError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is set: truncated images would pass as valid")
    fmt, w, h = image_header(data, where)
    if fmt == "PNG":
        # Pillow stops at the IEND chunk without checking it: a cut or flipped IEND would pass
        end = data.rfind(b"IEND")
        if end < 4 or data[end - 4 : end] != b"\0\0\0\0" or data[end + 4 : end + 8] != _IEND_CRC:
            raise CorruptImageError(
                f"{where}: does not decode (PNG without an intact IEND chunk: truncated or damaged)"
            )
    try:
        if fmt == "PNG":
            with Image.open(io.BytesIO(data)) as im:
                im.verify()  # reads every chunk up to IEND and checks its CRC
        with Image.open(io.BytesIO(data)) as im:
            im.load()
    except Exception as e:  # Pillow raises OSError, SyntaxError, ValueError, zlib.error ... for bad data
        raise CorruptImageError(f"{where}: does not decode ({type(e).__name__}: {e})") from e
    return fmt, w, h
