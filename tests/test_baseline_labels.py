"""What the README and docs/losses.md call the reality check's baselines is exactly the losses that implement MLRC's
methods: Proxy-Anchor is not one of them (MLRC names it among the unfair comparisons, not among its 14 methods)."""

from __future__ import annotations

import re
from pathlib import Path

from dml_core.losses import list_losses

ROOT = Path(__file__).resolve().parents[1]

#: MLRC's 14 methods (Contrastive, Triplet, NTXent, ProxyNCA, Margin, Margin / class, Normalized Softmax, CosFace,
#: ArcFace, FastAP, SNR Contrastive, Multi Similarity, MS + miner, SoftTriple) as this package names the 12 it has.
MLRC_METHODS = {
    "contrastive",
    "triplet",
    "ntxent",
    "proxynca",
    "margin",
    "normalized_softmax",
    "cosface",
    "arcface",
    "multi_similarity",
    "soft_triple",
}


def _names(text: str) -> set[str]:
    return set(re.findall(r"`([a-z_]+)`", text))


def test_the_readme_lists_exactly_mlrcs_methods_as_its_baselines():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("the reality-check baselines")
    listed = text[start : text.index(")", text.index("(", start))]
    assert _names(listed) == MLRC_METHODS
    assert MLRC_METHODS <= set(list_losses())


def test_docs_losses_baseline_table_holds_exactly_mlrcs_methods():
    text = (ROOT / "docs" / "losses.md").read_text(encoding="utf-8")
    section = text.split("## Reality-check baselines", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1) for m in re.finditer(r"^\| `([a-z_]+)` \|", section, re.M)}
    assert rows == MLRC_METHODS
    assert "| `proxy_anchor` |" in text, "proxy_anchor keeps its row, outside the baselines"
