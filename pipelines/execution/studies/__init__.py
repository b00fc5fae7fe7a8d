"""The studies of a sweep, one per (dataset, loss), run at once: their MLflow runs, protocol fingerprints, the
finished studies a sweep reuses, a continued or resumed sweep's checks, the Tuners of the search and the
reproductions, pruned trials' runs closed, the untrained reference row and the progress lines."""
