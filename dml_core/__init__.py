"""dml_core: the pure-PyTorch half of dml-reality-check.

Losses, retrieval metrics, class-disjoint splits, DDP-aware samplers, embedding models,
datasets, single-fold training and statistics.  Nothing in here imports Ray or MLflow,
so every part is unit-testable in one process.
"""

# The one definition of the package version: pyproject.toml reads it from here ([tool.setuptools.dynamic]).
__version__ = "0.1.0"
