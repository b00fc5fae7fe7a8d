"""Evaluation: embedding a dataset with a model, exact leave-one-out kNN (and its bf16 mode's bounds), the retrieval
metrics (MAP@R, R-Precision, P@1, Recall@k, nDCG@k, NMI), faiss's OpenBLAS kernel choice, and the statistics drawn from
fold and reproduction results (intervals, paired tests, the best group, expected validation performance)."""
