"""Running a sweep: preflight, the studies and their Bayesian-optimisation searches, trials, folds (warm Ray tasks or
Ray Train jobs), the Ray runtime, interrupts and progress."""
