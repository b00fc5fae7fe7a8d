"""One search space per built-in loss (``<loss>.yaml``: bounds, log/linear, fixed values, the paper's defaults), read
as package data by :mod:`pipelines.config.spaces`.  See README.md in this folder."""
