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


def test_a_packed_micro_batch_has_the_loss_of_the_padded_one_and_no_attention_across_samples():
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from raysft.dataloader import collate, num_tokens

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
    assert num_tokens(padded) == num_tokens(packed) == 31
    leaky = {**packed, "position_ids": torch.arange(31)[None]}  # as if the samples were one sequence
    with torch.no_grad():
        reference = loss(padded)
        torch.testing.assert_close(loss(packed), reference)
        assert not torch.allclose(loss(leaky), reference)  # without the restarts, samples attend to each other
