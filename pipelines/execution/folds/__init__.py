"""A trial and its folds: the Tune trainable that runs a trial's (or a reproduction's) four folds and reduces them,
what a fold's process is given and hands back (torch-free records), the one fold function, and the two executors that
run it (warm Ray tasks on pooled workers, or one Ray Train job per fold)."""
