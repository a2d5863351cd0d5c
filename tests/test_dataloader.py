import numpy as np
import pytest
import torch

from raysft.data.dataloader import DataCursor, GlobalBatchSampler, rank_micro_batches, token_budget_micro_batches


def batches(sampler, n):
    return [sampler.next_batch().tolist() for _ in range(n)]


def test_order_is_a_function_of_seed_epoch_and_position():
    a = batches(GlobalBatchSampler(50, 8, DataCursor(seed=1)), 14)
    assert a == batches(GlobalBatchSampler(50, 8, DataCursor(seed=1)), 14)
    assert a != batches(GlobalBatchSampler(50, 8, DataCursor(seed=2)), 14)
    # each epoch (6 full batches of 8 out of 50) sees distinct samples, and epochs are reshuffled
    assert len(set(sum(a[:6], []))) == 48 and a[:6] != a[6:12]


def test_resuming_from_a_saved_cursor_continues_the_same_sequence():
    full = batches(GlobalBatchSampler(50, 8, DataCursor(seed=3)), 10)
    sampler = GlobalBatchSampler(50, 8, DataCursor(seed=3))
    head = batches(sampler, 7)
    saved = sampler.cursor.state_dict()
    assert saved == {"seed": 3, "epoch": 1, "consumed": 8}
    tail = batches(GlobalBatchSampler(50, 8, DataCursor.from_state_dict(saved)), 3)
    assert head + tail == full


def test_ranks_partition_the_global_batch_into_micro_batches():
    global_batch = np.arange(16)
    parts = [rank_micro_batches(global_batch, r, 2, 4) for r in range(2)]
    assert all(len(p) == 2 and all(len(m) == 4 for m in p) for p in parts)
    assert sorted(np.concatenate([m for p in parts for m in p]).tolist()) == list(range(16))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_token_budget_micro_batches_are_a_function_of_the_global_batch(world_size):
    """Every sample of the global batch once, each micro-batch within the budget (or one sample over it), the
    same number of micro-batches on every rank, equal samples per rank, and the same cut whenever asked."""
    rng = np.random.default_rng(world_size)
    lengths = rng.integers(5, 200, 1000)
    lengths[7] = 300  # longer than the budget: alone in its micro-batch
    global_batch = rng.permutation(1000)[:48]
    global_batch[0] = 7
    def cut():
        return [token_budget_micro_batches(global_batch.copy(), lengths, r, world_size, 256) for r in range(world_size)]

    parts = cut()
    assert [[m.tolist() for m in p] for p in parts] == [[m.tolist() for m in p] for p in cut()]
    assert sorted(np.concatenate([m for p in parts for m in p]).tolist()) == sorted(global_batch.tolist())
    assert len({len(p) for p in parts}) == 1 and len({sum(map(len, p)) for p in parts}) == 1
    for m in (m for p in parts for m in p):
        assert lengths[m].sum() <= 256 or len(m) == 1
        assert [int(np.flatnonzero(global_batch == i)[0]) for i in m] == \
            sorted(int(np.flatnonzero(global_batch == i)[0]) for i in m)  # global-batch order inside
    tokens = [sum(int(lengths[m].sum()) for m in p) for p in parts]
    assert max(tokens) - min(tokens) <= 200  # snake dealing of the longest first: nearly equal tokens per rank


def test_token_budget_packs_near_the_budget():
    lengths = np.random.default_rng(0).integers(20, 120, 64)
    [mine] = [token_budget_micro_batches(np.arange(64), lengths, 0, 1, 1024)]
    assert len(mine) <= int(np.ceil(lengths.sum() / 1024)) + 1  # first-fit decreasing fills the bins


def test_too_little_data_is_an_error():
    with pytest.raises(ValueError, match="fewer than train.global_batch_size"):
        GlobalBatchSampler(5, 8, DataCursor(seed=0))


def test_a_packed_micro_batch_has_the_loss_of_the_padded_one_and_no_attention_across_samples():
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from raysft.data.dataloader import collate, sample_lengths

    gen = torch.Generator().manual_seed(0)

    class Samples:
        input_ids = [torch.randint(1, 100, (n,), generator=gen).tolist() for n in (7, 12, 3, 9)]
        labels = [[-100, -100, *ids[2:]] for ids in input_ids]

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128)).eval()

    def loss(batch):
        batch = dict(batch)
        labels = batch.pop("labels")
        logits = model(**batch, use_cache=False).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")

    padded, packed = collate(Samples, np.arange(4), 0), collate(Samples, np.arange(4), 0, packing=True)
    assert packed["input_ids"].shape == (1, 31) and "attention_mask" not in packed
    assert packed["position_ids"][0, 7:9].tolist() == [0, 1]  # the second sample starts over
    assert packed["cu_seq_lens_q"].tolist() == [0, 7, 19, 22, 31] and packed["max_length_q"] == 12
    assert sum(sample_lengths(padded)) == sum(sample_lengths(packed)) == 31
    leaky = {**packed, "position_ids": torch.arange(31)[None]}  # as if the samples were one sequence
    with torch.no_grad():
        reference = loss(padded)
        torch.testing.assert_close(loss(packed), reference)
        assert not torch.allclose(loss(leaky), reference)  # without the restarts, samples attend to each other


# --- reading the store lazily ---------------------------------------------------------------------------------------


def synthetic_store(store, lengths, files: int = 1, seed: int = 0):
    """A store of random token rows as the tokenizer would write them (labels mask a prefix of each sample); with
    files > 1, split as a Ray build splits it (samples-<chunk>.parquet, some chunk numbers missing)."""
    import pyarrow as pa

    from raysft.data.store import write_samples

    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = rng.integers(300, 32000, offsets[-1], dtype=np.int32)
    labels = np.where(np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths) < np.repeat(lengths // 2, lengths),
                      -100, ids).astype(np.int32)
    table = pa.table({"input_ids": pa.ListArray.from_arrays(offsets, ids),
                      "labels": pa.ListArray.from_arrays(offsets, labels),
                      "num_loss_tokens": pa.array((lengths - lengths // 2 - 1).astype(np.int32)),
                      "num_tokens": pa.array(np.asarray(lengths, dtype=np.int32)),
                      "source": pa.array(["synthetic"] * len(lengths)),
                      "record": pa.array(np.arange(len(lengths)))})
    store.mkdir(parents=True)
    if files == 1:
        write_samples(table, store / "samples.parquet")
    else:
        for i, part in enumerate(np.array_split(np.arange(len(lengths)), files)):
            write_samples(table.slice(part[0], len(part)), store / f"samples-{3 * i:05d}.parquet")
    return table


@pytest.mark.slow  # reads a whole table in many orders (seconds on 2 cores): make test-fast leaves it out
def test_lazy_reading_gives_the_samples_of_the_whole_table_in_any_order(tmp_path, monkeypatch):
    import raysft.data.store
    from raysft.data.dataloader import TokenizedDataset, collate

    monkeypatch.setattr(raysft.data.store, "ROW_GROUP_BYTES", 2048)  # many row groups per file
    lengths = np.random.default_rng(1).integers(2, 120, 1000)
    for files in (1, 7):
        table = synthetic_store(tmp_path / str(files), lengths, files)
        ds = TokenizedDataset(tmp_path / str(files), cached_row_groups=3)

        class Reference:  # what TokenizedDataset used to hold: the whole table as Python lists
            input_ids, labels = table["input_ids"].to_pylist(), table["labels"].to_pylist()

        assert len(ds) == len(ds.input_ids) == 1000 and sum(meta.num_row_groups for _, meta in ds._files) > 2 * files
        order = np.random.default_rng(2).permutation(1000)
        assert [ds.input_ids[i] for i in order] == [Reference.input_ids[i] for i in order]
        assert [ds.labels[i] for i in order] == [Reference.labels[i] for i in order]
        assert list(ds.input_ids) == Reference.input_ids and ds.labels[-1] == Reference.labels[-1]
        np.testing.assert_array_equal(ds.num_loss_tokens, table["num_loss_tokens"].to_numpy())
        np.testing.assert_array_equal(ds.num_tokens, lengths)
        for packing in (False, True):
            for batch in np.array_split(order, 50):
                got, want = collate(ds, batch, 0, packing), collate(Reference, batch, 0, packing)
                assert got.keys() == want.keys()
                assert all(torch.equal(got[k], want[k]) if isinstance(got[k], torch.Tensor) else got[k] == want[k]
                           for k in got)
        with pytest.raises(IndexError):
            ds.input_ids[1000]


@pytest.mark.slow  # writes and reads a 13M-token store (seconds on 2 cores): make test-fast leaves it out
def test_a_dataset_holds_one_integer_per_sample_not_its_tokens(tmp_path):
    """200k samples, 13M tokens (102 MB as int32 ids + labels; about 1 GB as the Python lists it used to hold). What
    the dataset allocates, Python objects (tracemalloc) and Arrow buffers (its memory pool) together, stays near the
    loss-token counts and a few row groups: the tokens stay on disk and in the page cache."""
    import gc
    import tracemalloc

    import pyarrow as pa

    from raysft.data.dataloader import TokenizedDataset
    from raysft.data.store import ROW_GROUP_BYTES

    lengths = np.random.default_rng(0).integers(32, 96, 200_000)
    synthetic_store(tmp_path / "store", lengths)
    token_bytes = 8 * int(lengths.sum())

    TokenizedDataset(tmp_path / "store")  # the first one imports modules: not memory that a dataset holds
    gc.collect()
    arrow_before = pa.total_allocated_bytes()
    tracemalloc.start()
    try:
        ds = TokenizedDataset(tmp_path / "store", cached_row_groups=16)
        opened = tracemalloc.get_traced_memory()[0] + pa.total_allocated_bytes() - arrow_before
        for i in np.random.default_rng(1).permutation(len(lengths))[:2000]:
            assert len(ds.input_ids[i]) == len(ds.labels[i]) == lengths[i]
        after_reads = tracemalloc.get_traced_memory()[0] + pa.total_allocated_bytes() - arrow_before
    finally:
        tracemalloc.stop()
    print(f"\ntokens {token_bytes / 2**20:.1f} MiB; held by the dataset: {opened / 2**20:.1f} MiB when opened, "
          f"{after_reads / 2**20:.1f} MiB after 2000 random reads")
    assert opened < 16 * len(lengths)  # the int32 loss-token counts (twice, while concatenating) and the index
    assert after_reads < 16 * len(lengths) + 16 * 1.5 * ROW_GROUP_BYTES  # + at most 16 decoded row groups
    assert after_reads < token_bytes / 10
