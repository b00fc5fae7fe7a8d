"""matplotlib's pyplot with the Agg backend: the charts and galleries are written to files and MLflow, never shown.

The backend must be chosen before pyplot is imported, so every module that draws takes ``plt`` from here.
matplotlib takes a second to import: the CLI's modules import this only where a command draws.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402 - after use("Agg"), as said above

__all__ = ["plt"]
