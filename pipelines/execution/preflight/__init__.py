"""The checks a sweep passes before Ray starts: its storage and tracking locations (sweep folder, sqlite file, MLflow
server, PostgreSQL store), its datasets loaded on the driver, and every study's folds, batches, model and loss built
once, giving one StudyPlan per (dataset, loss)."""
