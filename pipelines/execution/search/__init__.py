"""A study's hyperparameter search: the Optuna searcher seeded per trial number and the best-trial rule, and the
pruning of trials (the ASHA scheduler and the rungs a trial reports its fold-mean validation metric at)."""
