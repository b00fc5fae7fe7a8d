"""Training one fold: its checked settings (TrainConfig), the loop (train_fold and FoldResult), what DDP, AMP and the
lr schedule change in a step, the CPU's numerics choice, m-per-class batch sampling, and a fold's full training state
for mid-fold resume."""
