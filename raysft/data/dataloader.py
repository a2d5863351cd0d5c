"""Batches from the parquet store, in an order that is a pure function of (seed, epoch, position).

The position is one global cursor (epoch, samples consumed in it), not per-rank iterator state: every rank derives
the same global batch from it and takes its own slice, so a resumed run sees exactly the samples it would have
seen. Each optimizer step consumes `global_batch_size` samples; the last partial batch of an epoch is dropped.
"""

from __future__ import annotations

import functools
import operator
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from raysft.data.labels import IGNORE_INDEX
from raysft.data.store import store_files


@dataclass
class DataCursor:
    seed: int
    epoch: int = 0
    consumed: int = 0  # samples of this epoch already used

    def state_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict) -> DataCursor:
        return cls(**state)

    def load(self, other: DataCursor) -> None:
        """Take `other`'s place, in place (a sampler holds this cursor): a redone or healed step's."""
        self.seed, self.epoch, self.consumed = other.seed, other.epoch, other.consumed


class TokenizedDataset:
    """The store's samples, read from disk when asked for: a worker holds one integer per sample (the loss-token
    counts, which every step sums over its global batch) and a few decoded row groups, not the whole data set.

    `input_ids[i]` and `labels[i]` are lists of ints. A random read decodes the sample's row group (about
    data.ROW_GROUP_BYTES of tokens); the last `cached_row_groups` stay decoded, enough for a micro-batch's reads of
    both columns to decode each group once.
    """

    def __init__(self, store: Path, cached_row_groups: int = 64):
        # Footers only, no open files: a store built on Ray may have thousands of them.
        self._files = [(path, pq.read_metadata(path)) for path in store_files(store)]
        self.num_loss_tokens = np.concatenate(
            [pq.read_table(path, columns=["num_loss_tokens"]).column(0).to_numpy() for path, _ in self._files])
        self._groups = [(f, g) for f, (_, meta) in enumerate(self._files) for g in range(meta.num_row_groups)]
        self._starts = np.cumsum([0] + [self._files[f][1].row_group(g).num_rows for f, g in self._groups])
        self._cache: OrderedDict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = OrderedDict()
        self._cache_size = cached_row_groups
        self.input_ids, self.labels = _Column(self, "input_ids"), _Column(self, "labels")

    def __len__(self) -> int:
        return int(self._starts[-1])

    @functools.cached_property
    def num_tokens(self) -> np.ndarray:
        """Each sample's token count, which cutting micro-batches to a token budget needs for the whole global
        batch on every rank: the store's num_tokens column, read once when first asked for."""
        return np.concatenate([pq.read_table(path, columns=["num_tokens"]).column(0).to_numpy()
                               for path, _ in self._files])

    def _row(self, column: str, i: int) -> list[int]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        g = int(np.searchsorted(self._starts, i, side="right")) - 1
        offsets, values = self._group(g)[column]
        j = i - self._starts[g]
        return values[offsets[j] : offsets[j + 1]].tolist()

    def _group(self, g: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        group = self._cache.pop(g, None)
        if group is None:
            f, rg = self._groups[g]
            path, meta = self._files[f]
            with pq.ParquetFile(path, metadata=meta) as pf:
                table = pf.read_row_group(rg, columns=["input_ids", "labels"])
            group = {}
            for name in ("input_ids", "labels"):
                lists = table.column(name).combine_chunks()
                group[name] = lists.offsets.to_numpy(), lists.values.to_numpy()
            if len(self._cache) >= self._cache_size:
                self._cache.popitem(last=False)
        self._cache[g] = group
        return group


class _Column(Sequence):
    """One token column of a TokenizedDataset, indexable like the list of lists it replaces."""

    def __init__(self, dataset: TokenizedDataset, name: str):
        self._dataset, self._name = dataset, name

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        i = operator.index(i)
        return self._dataset._row(self._name, i + len(self) if i < 0 else i)


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


class GlobalBatchSampler:
    """Hands out global batches of sample indices and advances the cursor."""

    def __init__(self, num_samples: int, global_batch_size: int, cursor: DataCursor):
        if num_samples < global_batch_size:
            raise ValueError(f"the data has {num_samples} samples, "
                             f"fewer than train.global_batch_size={global_batch_size}")
        self.num_samples, self.global_batch_size, self.cursor = num_samples, global_batch_size, cursor
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def next_batch(self) -> np.ndarray:
        c = self.cursor
        if c.consumed + self.global_batch_size > self.num_samples:
            c.epoch, c.consumed = c.epoch + 1, 0
        if self._order_epoch != c.epoch:
            self._order, self._order_epoch = epoch_order(c.seed, c.epoch, self.num_samples), c.epoch
        batch = self._order[c.consumed : c.consumed + self.global_batch_size]
        c.consumed += self.global_batch_size
        return batch


def micro_batches(global_batch: np.ndarray, lengths: np.ndarray, rank: int, world_size: int, micro_batch_size: int,
                  micro_batch_tokens: int = 0) -> list[np.ndarray]:
    """This rank's micro-batches of a global batch, the one cut training and evaluation share: rows of about
    micro_batch_tokens tokens where that is set (token_budget_micro_batches), else micro_batch_size samples each.
    `rank` and `world_size` are data-parallel (raysft.distributed.layout: a sequence group takes one share)."""
    if micro_batch_tokens:
        return token_budget_micro_batches(global_batch, lengths, rank, world_size, micro_batch_tokens)
    return rank_micro_batches(global_batch, rank, world_size, micro_batch_size)


def lockstep_micro_batches(batch: np.ndarray, lengths: np.ndarray | None, rank: int, world_size: int,
                           micro_batch_size: int, micro_batch_tokens: int = 0) -> list[tuple[np.ndarray, bool]]:
    """This rank's micro-batches of `batch` (micro_batches' cut), as many as the rank that needs the most, each with
    whether it is real. FSDP gathers the parameters in every forward, on every rank alike, so a rank with fewer runs
    the batch's first sample again and drops what it computes (`real` False). A training step never needs that (its
    ranks take as many samples, and as many micro-batches: token_budget_micro_batches); evaluation and the reference
    pass, whose ranks may get fewer samples than others, do. `lengths` is read only with micro_batch_tokens."""
    cuts = [micro_batches(batch, lengths, r, world_size, micro_batch_size, micro_batch_tokens)
            for r in range(world_size)]  # a pure function: no communication
    mine, most = cuts[rank], max((len(c) for c in cuts), default=0)
    return [(m, True) for m in mine] + [(batch[:1], False)] * (most - len(mine))


def rank_micro_batches(global_batch: np.ndarray, rank: int, world_size: int, micro_batch_size: int) -> list[np.ndarray]:
    share = global_batch[rank :: world_size]
    return [share[i : i + micro_batch_size] for i in range(0, len(share), micro_batch_size)]


def token_budget_micro_batches(global_batch: np.ndarray, lengths: np.ndarray, rank: int, world_size: int,
                               budget: int) -> list[np.ndarray]:
    """This rank's micro-batches of at most `budget` tokens each (a longer sample goes alone), cut as a pure
    function of the global batch, its samples' lengths and the world size, so every rank computes every rank's cut.

    The samples, longest first, are dealt to the ranks in snake order (0, 1, …, W-1, W-1, …, 0): every rank gets
    the same number of samples and nearly the same number of tokens. Each rank packs its share first-fit-decreasing
    into budget-sized bins; then every rank splits its fullest bins until it has as many micro-batches as the rank
    that needs the most, because FSDP's collectives need the same number of forward/backward passes everywhere.
    Inside a micro-batch the samples keep their global-batch order. `lengths` holds every sample's token count
    (`TokenizedDataset.num_tokens`).
    """
    lengths = np.asarray(lengths)[global_batch]  # from here on, by position in the global batch
    order = sorted(range(len(global_batch)), key=lambda i: (-int(lengths[i]), i))
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for k, i in enumerate(order):
        lap, pos = divmod(k, world_size)
        shares[pos if lap % 2 == 0 else world_size - 1 - pos].append(i)
    bins = [_first_fit_decreasing(share, lengths, budget) for share in shares]
    mine = _split_until(bins[rank], max(len(b) for b in bins), lengths)
    return [global_batch[sorted(b)] for b in mine]


def _first_fit_decreasing(items: list[int], lengths: np.ndarray, budget: int) -> list[list[int]]:
    """`items` are longest first; each goes into the first bin with room for it, or opens a new one."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in items:
        n = int(lengths[i])
        j = next((j for j, r in enumerate(room) if r >= n), None)
        if j is None:
            bins.append([i])
            room.append(budget - n)
        else:
            bins[j].append(i)
            room[j] -= n
    return bins


def _split_until(bins: list[list[int]], count: int, lengths: np.ndarray) -> list[list[int]]:
    """Split the bin with the most tokens (of those with 2+ samples) in two until there are `count` bins. A rank of
    a training step has as many samples as any other, so it has enough for as many bins as any other needs; one
    with fewer (an evaluation's last round) stops at one sample a bin, and lockstep_micro_batches evens the counts
    out."""
    bins = [list(b) for b in bins]
    while len(bins) < count and any(len(b) > 1 for b in bins):
        j = max((j for j, b in enumerate(bins) if len(b) > 1), key=lambda j: sum(int(lengths[i]) for i in bins[j]))
        b = sorted(bins[j], key=lambda i: (-int(lengths[i]), i))
        bins[j : j + 1] = [b[0::2], b[1::2]]
    return bins


def collate(dataset: TokenizedDataset, indices: np.ndarray, pad_id: int,
            packing: bool = False) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sequence in this micro-batch (not to max_seq_len); with `packing`, one row of the
    samples back to back instead, no padding at all.

    Packed, each sample's position_ids restart at 0. transformers reads those restarts as sequence boundaries and
    masks attention across them (there is no attention_mask), and the label of each sample's first token is
    ignored, so no token learns from the sample before it: the loss is that of the padded batch. The sample
    boundaries also come as cumulative lengths (int32) and the longest sample, transformers' flash-attention
    kwargs, made here on the CPU so that no kernel has to find them on the device (`raysft.model.attention`).
    """
    rows = [dataset.input_ids[i] for i in indices]
    if packing:
        labels = [[IGNORE_INDEX, *dataset.labels[i][1:]] for i in indices]
        lengths = [len(r) for r in rows]
        cu_seq_lens = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
        return {"input_ids": torch.tensor([sum(rows, [])]), "labels": torch.tensor([sum(labels, [])]),
                "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
                "cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens,
                "max_length_q": max(lengths), "max_length_k": max(lengths)}
    longest = max(len(r) for r in rows)
    input_ids = torch.full((len(indices), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(indices), longest), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(indices), longest), dtype=torch.long)
    for row, (i, ids) in enumerate(zip(indices, rows, strict=True)):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(ids)] = torch.tensor(dataset.labels[i])
        attention_mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def sample_lengths(batch: dict[str, torch.Tensor]) -> list[int]:
    """Each sample's real token count, read off a collated batch (padded or packed)."""
    mask = batch.get("attention_mask")
    if mask is not None:
        return mask.sum(1).tolist()
    return np.diff(batch["cu_seq_lens_q"].numpy()).tolist()


def to_device(batch: dict, device: torch.device) -> dict:
    """The batch's tensors on the device. On CUDA they go through pinned memory with non-blocking copies: a copy
    from pageable memory makes the host wait for the GPU to finish the work queued before it (the previous
    micro-batch's backward), while this way the host goes on to queue the forward and prepare the next batch.
    Plain ints (the longest sample) stay on the host."""
    cuda = device.type == "cuda"
    return {k: (v.pin_memory().to(device, non_blocking=True) if cuda else v.to(device))
            if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def pair_rows(pairs: np.ndarray) -> np.ndarray:
    """The store rows of preference pairs (store.PAIR_SCHEMA: pair k is rows 2k, chosen, and 2k + 1, rejected), in
    the pairs' order, each pair's chosen row first: collated together, the two answers of a pair share their
    micro-batch, as separate rows when padded and separate samples of the row when packed."""
    pairs = np.asarray(pairs, dtype=np.int64)
    return np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1)


def pair_lengths(dataset: TokenizedDataset) -> np.ndarray:
    """Each pair's token count, both sequences: what a token budget cuts pairs by."""
    lengths = dataset.num_tokens
    return lengths[0::2] + lengths[1::2]
