"""DDP-aware m-per-class batch sampler.

MLRC (docs/protocol.md §Batch) trains with PML's ``MPerClassSampler(m=4)`` and batch 32, i.e.
8 classes × 4 samples; classes with fewer than ``m`` images are sampled with replacement (SOP).
The losses need every class of a batch to appear ``m`` times in the *global* batch, so under DDP
this sampler builds the global batch identically on every rank (same seed, same RNG stream) and each
rank yields its contiguous ``1/W`` slice.  Concatenating the ranks' slices in rank order therefore
gives exactly the single-process batch for the same seed — DDP changes nothing about what the
loss sees (a common failure of per-rank samplers, which draw different classes on each rank).

Batch construction (one global batch = ``classes_per_batch × m`` dataset indices, class-major):

* classes: dealt from a shuffled "deck" of all classes, ``classes_per_batch`` at a time; a new
  shuffle when the deck runs out.  So classes within a batch are distinct and, over an epoch,
  every class is drawn ``k`` or ``k + 1`` times (uniform coverage), unlike independent draws.
* samples: ``m`` distinct indices of the class if it has ``≥ m`` samples, else ``m`` draws with
  replacement (and a :class:`RepeatedImagesWarning` when the sampler is built).

Randomness: a ``numpy.random.Generator(PCG64)`` seeded from ``(seed, epoch)`` — never global state —
so ``set_epoch(e)`` gives a reproducible, epoch-specific stream.  Per-class index arrays are
precomputed once; per batch the work is vectorised and O(batch), independent of the dataset size.
"""

from __future__ import annotations

import warnings
from typing import Iterator

import numpy as np

__all__ = ["MPerClassBatchSampler", "RepeatedImagesWarning"]


class RepeatedImagesWarning(UserWarning):
    """Some classes have fewer than ``m`` images: their batches repeat images (drawn with replacement).  A caller
    that has already told the user (the sweep's preflight) may filter this category."""


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"MPerClassBatchSampler: {name} must be a positive integer, got {value!r}")
    return int(value)


class MPerClassBatchSampler:
    """Yields this rank's slice of global m-per-class batches; use as ``DataLoader(batch_sampler=...)``.

    Args:
        labels: one integer class id per dataset row (``dataset.labels``).
        m: samples per class in the global batch.
        classes_per_batch: distinct classes per global batch; global batch = ``classes_per_batch · m``.
        iters_per_epoch: batches per epoch (``len(sampler)``); an MLRC "epoch" is 100 iterations.
        seed: non-negative integer; the stream of epoch ``e`` is seeded from ``(seed, e)``.
        num_replicas, rank: DDP world size and this process's rank.
    """

    def __init__(
        self,
        labels,
        m: int,
        classes_per_batch: int,
        *,
        iters_per_epoch: int,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        self.m = _positive_int("m", m)
        self.classes_per_batch = _positive_int("classes_per_batch", classes_per_batch)
        self.iters_per_epoch = _positive_int("iters_per_epoch", iters_per_epoch)
        self.num_replicas = _positive_int("num_replicas", num_replicas)
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.num_replicas:
            raise ValueError(
                f"MPerClassBatchSampler: rank must be in [0, num_replicas={self.num_replicas}), got {rank!r}"
            )
        self.rank = int(rank)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"MPerClassBatchSampler: seed must be a non-negative integer, got {seed!r}")
        self.seed = int(seed)

        self.global_batch_size = self.classes_per_batch * self.m
        if self.global_batch_size % self.num_replicas:
            raise ValueError(
                f"MPerClassBatchSampler: global batch classes_per_batch × m = {self.classes_per_batch} × {self.m} "
                f"= {self.global_batch_size} is not divisible by num_replicas = {self.num_replicas}"
            )
        self.batch_size = self.global_batch_size // self.num_replicas  # this rank's slice

        labels = np.asarray(labels)
        if labels.ndim != 1 or labels.size == 0:
            raise ValueError(f"MPerClassBatchSampler: labels must be a non-empty 1-D array, got shape {labels.shape}")
        if not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"MPerClassBatchSampler: labels must be integer class ids, got dtype {labels.dtype}")

        # Per-class index arrays as one CSR-like layout: rows of class c are
        # self._order[self._starts[c] : self._starts[c] + self._counts[c]].
        self._order = np.argsort(labels, kind="stable")
        self.classes, self._starts, self._counts = np.unique(labels[self._order], return_index=True, return_counts=True)
        if len(self.classes) < self.classes_per_batch:
            raise ValueError(
                f"MPerClassBatchSampler: the dataset has {len(self.classes)} classes, fewer than "
                f"classes_per_batch = {self.classes_per_batch}"
            )
        small = np.flatnonzero(self._counts < self.m)
        if len(small) and self.rank == 0:  # one warning per sampler, not one per DDP rank
            c = small[0]
            warnings.warn(
                f"MPerClassBatchSampler: {len(small)} of {len(self.classes)} classes have fewer than m = {self.m} "
                f"images (e.g. class {self.classes[c]}: {self._counts[c]}); their batches repeat images (drawn with "
                "replacement, as PML's MPerClassSampler does)",
                RepeatedImagesWarning,
                stacklevel=2,
            )
        self.epoch = 0

    def __len__(self) -> int:
        return self.iters_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Reseed deterministically from ``(seed, epoch)``; call before iterating each epoch."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"MPerClassBatchSampler: epoch must be a non-negative integer, got {epoch!r}")
        self.epoch = int(epoch)

    def global_batches(self) -> Iterator[np.ndarray]:
        """The epoch's global batches (every rank computes the same ones), class-major order."""
        rng = np.random.Generator(np.random.PCG64([self.seed, self.epoch]))
        n_classes, cpb = len(self.classes), self.classes_per_batch
        deck = rng.permutation(n_classes)
        pos = 0
        for _ in range(self.iters_per_epoch):
            if pos + cpb <= n_classes:
                chosen = deck[pos : pos + cpb]
                pos += cpb
            else:
                # Deck runs out mid-batch: keep its tail, reshuffle, and move the tail's classes
                # to the end of the new deck so the batch's classes stay distinct (needs n ≥ cpb).
                tail = deck[pos:]
                fresh = rng.permutation(n_classes)
                fresh = np.concatenate([fresh[~np.isin(fresh, tail)], tail])
                need = cpb - len(tail)
                chosen = np.concatenate([tail, fresh[:need]])
                deck, pos = fresh, need
            yield self._draw_samples(rng, chosen)

    def _draw_samples(self, rng: np.random.Generator, chosen: np.ndarray) -> np.ndarray:
        """``m`` sample indices for each chosen class (vectorised over classes)."""
        m = self.m
        counts = self._counts[chosen]  # (cpb,)
        # Sequential sampling without replacement: draw j picks uniformly among the counts - j
        # positions not taken yet, then skips over the (sorted) positions already taken.
        # Classes with counts < m fall back to draws with replacement (PML MPerClassSampler).
        small = counts < m
        picks = np.empty((len(chosen), m), dtype=np.int64)
        high = np.where(small[:, None], counts[:, None], counts[:, None] - np.arange(m)[None, :])
        raw = rng.integers(0, high)  # (cpb, m), one call per batch
        for j in range(m):
            val = raw[:, j].copy()
            if j:
                taken = np.sort(picks[:, :j], axis=1)
                for k in range(j):
                    val += (~small) & (val >= taken[:, k])
            picks[:, j] = val
        return self._order[self._starts[chosen][:, None] + picks].reshape(-1)

    def __iter__(self) -> Iterator[list[int]]:
        lo = self.rank * self.batch_size
        for batch in self.global_batches():
            yield batch[lo : lo + self.batch_size].tolist()

    def __repr__(self) -> str:
        return (
            f"MPerClassBatchSampler(classes={len(self.classes)}, m={self.m}, "
            f"classes_per_batch={self.classes_per_batch}, "
            f"iters_per_epoch={self.iters_per_epoch}, seed={self.seed}, epoch={self.epoch}, "
            f"rank={self.rank}/{self.num_replicas})"
        )
