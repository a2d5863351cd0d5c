import numpy as np
import pytest

from raysft.dataloader import DataCursor, GlobalBatchSampler, rank_micro_batches


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


def test_too_little_data_is_an_error():
    with pytest.raises(ValueError, match="fewer than train.global_batch_size"):
        GlobalBatchSampler(5, 8, DataCursor(seed=0))
