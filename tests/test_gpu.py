"""What only a CUDA device can show; skipped without one (docs/BENCHMARKS.md has the commands to run on a GPU):
flash varlen attention against the per-sample SDPA reference, and deterministic kernels repeating a step bit for
bit (the memory-efficient SDPA backward would not), parallel.cpu_offload training on a group with gloo beside
NCCL, and FP8's converted layers against bf16 (on a GPU with FP8 tensor cores)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO
from test_loss import Samples
from transformers import AutoModelForCausalLM, LlamaConfig

from raysft.data.dataloader import collate, to_device
from raysft.model.attention import per_sample_sdpa, varlen_attention_forward
from raysft.model.loss import install_chunked_loss, loss_inputs, micro_batch_loss_sum
from raysft.training.trainer import use_deterministic_kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_flash_varlen_equals_the_per_sample_reference_in_bf16():
    torch.manual_seed(0)
    cu = torch.tensor([0, 7, 19, 22, 31], dtype=torch.int32, device="cuda")
    q = torch.randn(1, 8, 31, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 2, 31, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    flash, _ = varlen_attention_forward(None, q, k, v, None, scaling=0.125, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                        max_length_q=12, max_length_k=12)
    reference = per_sample_sdpa(q, k, v, cu, 0.125)
    torch.testing.assert_close(flash, reference, atol=2e-2, rtol=2e-2)
    grads = [torch.autograd.grad(out.float().square().sum(), (q, k, v)) for out in (flash, reference)]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


def test_deterministic_kernels_repeat_a_step_bit_for_bit():
    use_deterministic_kernels(torch.device("cuda"))
    try:
        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=128)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="varlen", dtype=torch.bfloat16).cuda()
        install_chunked_loss(model, 8)
        batch = collate(Samples, np.arange(4), 0, packing=True)
        batch = to_device({**batch, **loss_inputs(batch.pop("labels"))}, torch.device("cuda"))
        runs = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            loss = micro_batch_loss_sum(model, batch)
            loss.backward()
            runs.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    finally:
        torch.use_deterministic_algorithms(False)


def test_cpu_offload_trains_under_nccl_with_gloo_for_the_offloaded_gradients(tmp_path):
    # the offloaded gradients and their norms are CPU tensors: NCCL alone cannot reduce them (clip_grad_norm_)
    sets = ["parallel.cpu_offload=true", "data.max_seq_len=64", "train.max_steps=3", "train.warmup_steps=1",
            "checkpoint.every_n_steps=3", f"run.storage_path={tmp_path / 'runs'}", "run.name=offload"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m",
               "raysft.run", *(arg for s in sets for arg in ("--set", s))]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HOME": str(tmp_path)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "runs" / "offload" / "checkpoint_00000003").is_dir()


def test_fp8_layers_compute_what_bf16_computes_within_float8s_error():
    # the converted model against the same weights in bf16: the loss and every gradient close (float8 e4m3 keeps 3
    # mantissa bits and the gradients e5m2 2: a product is off by up to 1/16 or 1/8, errors that mostly cancel in sums)
    from raysft.parallel.fp8 import FP8_CAPABILITY, convert_to_fp8, require_fp8

    pytest.importorskip("torchao", reason="torchao: pip install 'raysft[fp8]' (the device check's bundle has it)")
    if torch.cuda.get_device_capability() < FP8_CAPABILITY:
        pytest.skip(f"{torch.cuda.get_device_name()} has no FP8 tensor cores")
    require_fp8("cuda")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda()
    model.load_state_dict(reference.state_dict())
    assert len(convert_to_fp8(model)) == 14  # 4 attention and 3 MLP projections a layer; not the LM head
    ids = torch.randint(0, 256, (4, 64), device="cuda")
    losses, grads = [], []
    for m in (reference, model):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.float().flatten() for p in m.parameters()]))
    assert losses[1] == pytest.approx(losses[0], rel=0.02)
    assert torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0) > 0.95


def test_the_memory_tiers_staging_copy_lands_whole_from_the_last_device_in_its_own_thread():
    """The memory tier's staging buffer allocated and page-locked in a thread of its own (the tier's: its current
    device is 0) for the last visible device, the step's shards copied on the side stream, the copy's bytes
    compared with the shards' (not only its time)."""
    import threading

    from raysft.checkpoint.memory.files import views
    from raysft.checkpoint.memory.staging import Stager

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    torch.cuda.set_device(device)
    g = torch.Generator(device=device).manual_seed(0)
    shards = {"model.w": torch.randn(1024, 257, device=device, generator=g),
              "model.b": torch.randn(3, device=device, dtype=torch.bfloat16, generator=g),
              "optim.w.step": torch.tensor(7.0, device=device)}
    stager = Stager(device)
    thread = threading.Thread(target=stager.allocate, args=({k: v.to("meta") for k, v in shards.items()},))
    thread.start()
    thread.join()
    assert stager.fits(shards)
    stager.copy(shards)
    expected = {k: v.cpu() for k, v in shards.items()}
    stager.before_update()  # the optimizer's pre-hook: the next update waits for the copy, on the device
    for v in shards.values():
        v.add_(1)
    done = threading.Thread(target=stager.landed)
    done.start()
    done.join()
    landed = views(stager.buffer, stager.slots)
    assert all(torch.equal(landed[k], expected[k]) for k in shards)
    stager.release()
