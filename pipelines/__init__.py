"""pipelines: orchestration of the reality-check protocol (Ray Tune, Ray Train, MLflow, reports, CLI)."""
