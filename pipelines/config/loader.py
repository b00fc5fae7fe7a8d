"""The hardened YAML reader every config file goes through (sweep configs, search spaces, re-evaluation configs):
bounded size, UTF-8 only, no duplicate keys, non-string keys refused, alias expansion bounded ("billion laughs"),
errors as one :class:`ConfigError` line naming the file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from pipelines.config.errors import ConfigError

__all__ = ["load_yaml", "read_yaml_file", "MAX_CONFIG_BYTES", "MAX_YAML_NODES"]

#: A config file larger than this is not a config (and would be slow to parse).
MAX_CONFIG_BYTES = 1 << 20
#: YAML aliases may share a node many times over ("billion laughs"): bound the expanded document.
MAX_YAML_NODES = 20_000


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader; :func:`load_yaml` inspects the composed node graph before constructing it."""


def _check_nodes(root: yaml.Node, source: str) -> None:
    """Reject duplicate mapping keys and documents whose aliases expand beyond ``MAX_YAML_NODES`` nodes."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def walk(node: yaml.Node, path: str) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise ConfigError(source, f"recursive YAML alias at {path or 'the top level'}")
        active.add(key)
        total = 1
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                    name = (k.tag, k.value)
                    sub = f"{path}.{k.value}" if path else str(k.value)
                    if k.tag != "tag:yaml.org,2002:str":
                        raise ConfigError(
                            sub,
                            f"keys must be strings; YAML reads {k.value!r} as {k.tag.rsplit(':', 1)[-1]} (quote it)",
                        )
                    if name in seen:
                        raise ConfigError(sub, f"duplicate key (lines {seen[name] + 1} and {k.start_mark.line + 1})")
                    seen[name] = k.start_mark.line
                else:
                    sub = path
                total += walk(k, sub) + walk(v, sub)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                total += walk(v, f"{path}[{i}]")
        active.discard(key)
        sizes[key] = total
        if total > MAX_YAML_NODES:
            raise ConfigError(source, f"the document (its YAML aliases expanded) has more than {MAX_YAML_NODES} nodes")
        return total

    walk(root, "")


def load_yaml(text: str, source: str) -> Any:
    """Parse one YAML document safely: no duplicate keys, bounded alias expansion, errors as one line."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_nodes(node, source)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise ConfigError(source, "not valid YAML: " + " ".join(str(e).split())) from None
    except RecursionError:
        raise ConfigError(source, "not valid YAML: nested too deeply") from None
    finally:
        loader.dispose()


def read_yaml_file(path: str | os.PathLike, what: str = "config file") -> Any:
    """Read and parse one YAML file; a missing, unreadable, oversized, non-UTF-8 or unparsable file is a
    :class:`ConfigError` naming it."""
    path = Path(path)
    src = str(path)
    try:
        if not path.is_file():
            raise ConfigError(src, f"is a directory, not a {what}" if path.is_dir() else f"{what} not found")
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(src, f"{path.stat().st_size} bytes is too large for a {what} (limit {MAX_CONFIG_BYTES})")
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(src, f"cannot read: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(src, f"not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    return load_yaml(text, src)
