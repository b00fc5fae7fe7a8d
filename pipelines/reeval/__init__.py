"""`dmlrc reeval`: registered models re-evaluated on current data, with a regression verdict."""
