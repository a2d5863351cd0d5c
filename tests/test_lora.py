"""LoRA (model.lora) on FSDP2 with real peft and real gloo collectives (reused process pools, no Ray): training,
checkpoints that hold only the adapters, exact resume, and both exports."""

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import STEPS, cli_in_process, run_config, step_losses, tiny_config
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

import raysft
from raysft.checkpoint import (
    STATE_FILE,
    CheckpointError,
    DirectorySink,
    checkpoint_dirs,
    incomplete_reason,
    is_payload,
    read_index,
    read_manifest,
)
from raysft.config import ConfigError, ModelConfig, config_from_dict, load_config
from raysft.data import prepare_store
from raysft.data.tokenizer import load_tokenizer
from raysft.launch.torchrun import launch, prepare_on_rank0, run_trainer
from raysft.model.build import build_full_model, load_model_config
from raysft.model.lora import is_adapter
from raysft.model.seeded_init import INIT_SCHEME
from raysft.products.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from raysft.products.chat_model import ChatModel
from raysft.training.metrics import read_metrics
from raysft.training.trainer import Trainer

peft = pytest.importorskip("peft")
LORA = {"model.lora.r": 4, "model.lora.alpha": 8, "model.lora.target_modules": "[q_proj, v_proj, down_proj]",
        "train.lr": 1e-2, "train.warmup_steps": 1}
IDS = torch.tensor([[1, 5, 9, 23, 42, 77, 100, 3]])


def _train_and_logits(ctx, cfg) -> torch.Tensor:
    """Collective: one launch, then the live (sharded) model's logits on IDS."""
    trainer = run_trainer(cfg, prepare_on_rank0(cfg, False), ctx)
    trainer.train()
    trainer.model.eval()
    with torch.no_grad():
        return trainer.model(input_ids=IDS).logits


@pytest.fixture(scope="module")
def reference(gloo_pool, tmp_path_factory):
    """An uninterrupted LoRA run, full checkpoints, from scratch: its losses, its run dir and its final logits."""
    cfg = run_config(tmp_path_factory.mktemp("lora"), "reference", **{**LORA, "checkpoint.mode": "full"})
    logits = gloo_pool.run(_train_and_logits, cfg)[0]
    return step_losses(cfg.run_dir), cfg.run_dir, logits


def test_lora_training_lowers_the_loss_and_checkpoints_only_the_adapters(reference):
    losses, run_dir, _ = reference
    assert [s for s, _ in losses] == list(range(1, STEPS + 1))
    first, last = losses[0][1], sum(v for _, v in losses[-3:]) / 3
    assert last < first - 0.1, losses
    ckpt = checkpoint_dirs(run_dir)[-1]
    weights, optim = load_file(ckpt / "model.safetensors"), load_file(ckpt / "optimizer.safetensors")
    # 4 layers × 3 adapted modules × (A, B); AdamW's step and two moments for each of them, nothing else
    assert len(weights) == 24 and all(is_adapter(k) for k in weights), sorted(weights)[:4]
    assert {k.rpartition("/")[0] for k in optim} == set(weights) and len(optim) == 3 * 24
    # the same manifest as full fine-tuning: every file, the payload included, with a sha256 that checks out
    assert {"model.safetensors", "optimizer.safetensors", "trainer_state.json"} <= set(read_manifest(ckpt))
    assert incomplete_reason(ckpt, checksums=True) is None
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["lora"] == {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"],
                             "base": {"path": "", "seed": 0, "init": INIT_SCHEME}}
    assert json.loads((run_dir / "raysft_run.json").read_text())["model.lora"]["r"] == 4


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_lora_stop_and_resume_across_modes_is_bit_identical(tmp_path, gloo_pool, reference):
    """Sharded (async) to step 4, full to step 8, sharded to the end: the frozen base is rebuilt on every launch,
    the adapters, their AdamW state and the RNG come from the checkpoint; losses and adapters equal, bit for bit."""
    ref_losses, ref_dir, _ = reference
    for sets in ({"checkpoint.mode": "sharded", "checkpoint.async": True, "train.stop_at_step": 4},
                 {"checkpoint.mode": "full", "train.stop_at_step": 8}, {"checkpoint.mode": "sharded"}):
        gloo_pool.run(launch, cfg := run_config(tmp_path, "resumed", **{**LORA, "checkpoint.keep": 9, **sets}))
    assert [m["step"] for m in read_metrics(cfg.run_dir) if m.get("event") == "resume"] == [4, 8]
    assert step_losses(cfg.run_dir) == ref_losses
    sharded = cfg.run_dir / f"checkpoint_{STEPS:08d}"
    index = read_index(sharded).state_dict_metadata
    model_keys = {k.removeprefix("model.") for k in index if k.startswith("model.")}
    assert len(model_keys) == 24 and all(is_adapter(k) for k in model_keys)
    assert all(is_adapter(k.split(".", 2)[2]) for k in index if k.startswith("optimizer.state."))
    # 15k adapter parameters × 3 (weights, 2 moments) and DCP's ~0.5 kB per tensor piece; the base alone is 4.8 MB
    assert sum(p.stat().st_size for p in sharded.glob("*.distcp")) < 600_000
    assert {p.name for p in sharded.glob("*.distcp")} == {n for n in read_manifest(sharded) if is_payload(n)}
    assert incomplete_reason(sharded, checksums=True) is None
    mine = raysft.export(sharded, tmp_path / "a")
    theirs = raysft.export(checkpoint_dirs(ref_dir)[-1], tmp_path / "b")
    a, b = load_file(mine / ADAPTER_WEIGHTS), load_file(theirs / ADAPTER_WEIGHTS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(RuntimeError, match="ConfigError: .*model.lora must match"):  # part of the run identity
        gloo_pool.run(launch, run_config(tmp_path, "resumed", **{**LORA, "model.lora.r": 8}))


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_lora_with_dropout_resumes_bit_identically(tmp_path, gloo_pool):
    """Adapter dropout draws from each rank's RNG stream, which the checkpoint carries: a run stopped at step 3
    and resumed draws the masks the uninterrupted run drew, so its losses and adapters equal it bit for bit."""
    sets = {**LORA, "model.lora.dropout": 0.2, "train.max_steps": 6, "checkpoint.mode": "sharded"}
    gloo_pool.run(launch, ref := run_config(tmp_path, "uninterrupted", **sets))
    for stop in ({"train.stop_at_step": 3}, {}):
        gloo_pool.run(launch, cfg := run_config(tmp_path, "resumed", **sets, **stop))
    assert [m["step"] for m in read_metrics(cfg.run_dir) if m.get("event") == "resume"] == [3]
    assert step_losses(cfg.run_dir) == step_losses(ref.run_dir)
    a, b = (load_file(raysft.export(d / "checkpoint_00000006", tmp_path / d.name) / ADAPTER_WEIGHTS)
            for d in (cfg.run_dir, ref.run_dir))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_merged_and_adapter_exports_give_the_live_models_logits(tmp_path, reference):
    """From the full checkpoint of a run trained from scratch: the merged export loads in transformers, the adapter
    export in peft on top of the seeded base, and both give the logits the sharded model computed."""
    _, run_dir, live = reference
    ckpt = checkpoint_dirs(run_dir)[-1]
    merged = raysft.export(ckpt, tmp_path / "merged", merge=True)
    assert not (merged / ADAPTER_CONFIG).exists()
    model = AutoModelForCausalLM.from_pretrained(merged, local_files_only=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS).logits, live, rtol=1e-4, atol=1e-4)

    adapter = raysft.export(ckpt, tmp_path / "adapter")
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS} <= {p.name for p in adapter.iterdir()}
    assert not (adapter / "model.safetensors").exists()
    adapter_config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    assert (adapter_config["r"], adapter_config["lora_alpha"]) == (4, 8)  # LORA's, not peft's defaults (8, 8)
    assert sorted(adapter_config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    base = build_full_model(ModelConfig(), AutoConfig.from_pretrained(adapter), seed=0)
    with torch.no_grad():  # the adapters matter: the base alone gives other logits
        assert not torch.allclose(base(input_ids=IDS).logits, live, atol=1e-2)
    peft_model = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=IDS).logits, live, rtol=1e-4, atol=1e-4)
    # `raysft chat` takes the adapter directory, the merged model and the checkpoint, and they answer alike
    outs = [cli_in_process("chat", str(p), "--prompt", "What is the capital of France?", "--max-new-tokens", "8")
            for p in (adapter, merged, ckpt)]
    assert all(o.returncode == 0 for o in outs), [o.stderr[-2000:] for o in outs]
    answers = {o.stdout for o in outs}
    assert len(answers) == 1 and answers.pop().strip(), [o.stdout for o in outs]
    full_ft = tmp_path / "full-ft"  # a full fine-tuning checkpoint's state: no adapters to merge
    full_ft.mkdir()
    (full_ft / STATE_FILE).write_text(json.dumps({"format_version": 1, "mode": "full", "step": 1, "cursor": {},
                                                  "scheduler": {}, "world_size": 1}))
    with pytest.raises(ValueError, match="--merge applies to LoRA checkpoints"):
        raysft.export(full_ft, tmp_path / "no", merge=True)


# (sharding, activation checkpointing, mixed precision, packing: "" padded, else the packed rows' attention with
# train.micro_batch_tokens cutting each worker's share into token-budget micro-batches): every strategy once in fp32,
# held tightly against one process, and once with all of bf16, activation checkpointing and token-budget packing
STRATEGY_VARIANTS = [
    ("FULL_SHARD", "full", "fp32", "varlen"), ("SHARD_GRAD_OP", "none", "fp32", ""),
    ("HYBRID_SHARD", "2", "fp32", "sdpa"), ("NO_SHARD", "full", "fp32", ""),
    ("FULL_SHARD", "full", "bf16", "varlen"), ("SHARD_GRAD_OP", "2", "bf16", "varlen"),
    ("HYBRID_SHARD", "full", "bf16", "varlen"), ("NO_SHARD", "full", "bf16", "sdpa")]
PACKED_BUDGET = 192  # tokens per micro-batch: 2 samples of up to 96 tokens, so each worker's 4 take 2 or more


def _variant_name(sharding: str, ac: str, precision: str, packing: str) -> str:
    return f"{sharding}-{ac}-{precision}-{packing or 'padded'}"


def _train_each_strategy(ctx, config: dict, store: Path) -> None:
    for sharding, ac, precision, packing in STRATEGY_VARIANTS:
        cfg = config_from_dict(config)
        p = cfg.parallel
        p.sharding, p.activation_checkpointing, p.mixed_precision = sharding, ac, precision
        p.hsdp_shard_size = 2 if sharding == "HYBRID_SHARD" else 0
        if packing:
            cfg.data.packing, cfg.model.attn_implementation = True, packing
            cfg.train.micro_batch_tokens = PACKED_BUDGET
        cfg.run.name = _variant_name(sharding, ac, precision, packing)
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        Trainer(cfg, store, None, DirectorySink(cfg.run_dir, ctx.rank), ctx).train()


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_lora_trains_alike_in_every_strategy_with_checkpointing_mixed_precision_and_packing(tmp_path, gloo_pool4):
    """4 gloo processes: frozen base and adapters in the same FSDP2 groups, against one process with peft. Every
    strategy also runs with bf16, activation checkpointing and packed rows cut by train.micro_batch_tokens together
    (bf16 moves the loss by about 1e-4 of itself here; the three steps lower it by 5 %)."""
    from test_strategies import STEPS as N
    from test_strategies import reference as one_process

    cfg = tiny_config(tmp_path, **{**LORA, "train.max_steps": N, "train.global_batch_size": 16,
                                   "train.micro_batch_size": 2, "scaling.num_workers": 4})
    store = prepare_store(cfg.data, load_tokenizer(cfg.model, cfg.data.chat_template), cfg.store_dir).path
    gloo_pool4.run(_train_each_strategy, cfg.to_dict(), store)
    ref_losses, _ = one_process(cfg, store)
    assert ref_losses[-1] < ref_losses[0] - 0.1  # the adapters learn, by more than the bf16 tolerance below
    for variant in STRATEGY_VARIANTS:
        name, packing = _variant_name(*variant), variant[3]
        rows = [m for m in read_metrics(cfg.run_dir.parent / name) if "loss" in m]
        assert [m["step"] for m in rows] == list(range(1, N + 1)), name
        if packing:  # packed rows: no pad token computed
            assert all(m["computed_tokens"] == m["tokens"] for m in rows), name
        tol = dict(rtol=1e-5, atol=1e-6) if variant[2] == "fp32" else dict(rtol=2e-3, atol=0)
        torch.testing.assert_close([m["loss"] for m in rows], ref_losses, **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_lora_resumes_on_another_worker_count_and_strategy(tmp_path, gloo_pool4, gloo_pool, reference):
    """4 workers, HYBRID_SHARD, sharded checkpoint → 2 workers, FULL_SHARD, full checkpoint: the same samples and
    steps as the uninterrupted 2-worker run (only the reduction order differs)."""
    ref_losses = reference[0]
    for pool, sets in ((gloo_pool4, {"scaling.num_workers": 4, "parallel.sharding": "HYBRID_SHARD",
                                     "parallel.hsdp_shard_size": 2, "checkpoint.mode": "sharded",
                                     "train.stop_at_step": 3}),
                       (gloo_pool, {"checkpoint.mode": "full", "train.stop_at_step": 6})):
        pool.run(launch, cfg := run_config(tmp_path, "elastic", **{**LORA, "train.micro_batch_size": 2, **sets}))
    losses = step_losses(cfg.run_dir)
    assert [s for s, _ in losses] == list(range(1, 7))
    torch.testing.assert_close([v for _, v in losses], [v for _, v in ref_losses[:6]], rtol=1e-4, atol=1e-5)


def test_a_missing_peft_is_a_config_error_naming_the_key_and_the_extra(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"'model.lora'.*raysft\[lora\]"):
        load_config(None, ["model.lora.r=8"])
    load_config(None, ["model.lora.r=0"])  # full fine-tuning does not need it


def test_loading_adapters_that_do_not_match_the_models_is_refused_naming_the_checkpoint():
    """Loading is not strict under LoRA (the frozen base is in no checkpoint), so raysft compares the names itself:
    an adapter the checkpoint lacks would otherwise keep its initial value without a word."""
    from raysft.checkpoint import CheckpointError
    from raysft.checkpoint.trainable import check_adapter_names
    from raysft.model.build import build_meta_model
    from raysft.model.lora import add_adapters

    cfg = load_config(None, ["model.lora.r=4", "model.lora.target_modules=[q_proj]"])
    hf_config = load_model_config(cfg.model, load_tokenizer(cfg.model, "auto"))
    model = add_adapters(build_meta_model(hf_config, "sdpa"), cfg.model.lora)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(names) == 2 * hf_config.num_hidden_layers and all(is_adapter(n) for n in names)
    check_adapter_names(model, names, "ckpt_a")
    with pytest.raises(CheckpointError, match=r"ckpt_b: .* 1 missing .* 0 unexpected"):
        check_adapter_names(model, names[1:], "ckpt_b")
    with pytest.raises(CheckpointError, match=r"ckpt_c: .* 0 missing .* 1 unexpected"):
        check_adapter_names(model, [*names, "model.layers.0.self_attn.k_proj.lora_A.default.weight"], "ckpt_c")


def test_target_modules_that_name_no_layer_are_a_config_error_on_the_driver():
    from raysft.launch.prelaunch import check_model

    cfg = load_config(None, ["model.lora.r=4", "model.lora.target_modules=[q_proj, qkv_proj]"])
    check_model(cfg, load_tokenizer(cfg.model, "auto"))  # peft adapts the layers that match any name
    cfg = load_config(None, ["model.lora.r=4", "model.lora.target_modules=[qkv_proj]"])
    with pytest.raises(ConfigError, match="model.lora.target_modules.*qkv_proj"):
        check_model(cfg, load_tokenizer(cfg.model, "auto"))


def test_a_lora_run_on_a_pretrained_base_exports_merged_with_the_cli_and_as_an_adapter_chat_loads(tmp_path,
                                                                                                gloo_pool):
    """model.path: a sharded HF directory. The merged export streams its safetensors shards; the adapter export
    names it as peft's base_model_name_or_path; both give the same logits, and `raysft chat` loads the adapter.
    Once the base is changed (one tensor, same shape), both refuse it, naming the file: the checkpoint's record
    holds the fingerprint of the base the adapters were trained on."""
    from raysft.cli import main

    tokenizer = load_tokenizer(ModelConfig(), "auto")
    base_dir = tmp_path / "base"
    build_full_model(ModelConfig(), load_model_config(ModelConfig(), tokenizer), seed=3).save_pretrained(
        base_dir, max_shard_size="2MB")
    tokenizer.save_pretrained(base_dir)
    assert (base_dir / "model.safetensors.index.json").is_file()
    cfg = run_config(tmp_path, "pretrained", **{**LORA, "model.path": str(base_dir), "train.max_steps": 2,
                                                "checkpoint.mode": "sharded"})
    gloo_pool.run(launch, cfg)
    ckpt = checkpoint_dirs(cfg.run_dir)[-1]
    assert main(["export", str(ckpt), str(tmp_path / "merged"), "--merge", "--max-shard-mb", "1"]) == 0
    assert (tmp_path / "merged" / "model.safetensors.index.json").is_file()  # streamed in 1 MiB shards
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True).eval()
    adapter = raysft.export(ckpt, tmp_path / "adapter")
    assert json.loads((adapter / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == str(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True)
    with torch.no_grad():
        base_logits = base(input_ids=IDS).logits
        peft_logits = peft.PeftModel.from_pretrained(base, str(adapter)).eval()(input_ids=IDS).logits
        torch.testing.assert_close(merged(input_ids=IDS).logits, peft_logits, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(base_logits, peft_logits, atol=1e-3)  # two steps at lr 1e-2 moved the adapters
    with torch.no_grad():  # `raysft chat` on the adapter directory: the pretrained base with the adapters on top
        torch.testing.assert_close(ChatModel.load(adapter).model(input_ids=IDS).logits, peft_logits)
    outs = [cli_in_process("chat", str(p), "--prompt", "Hi", "--max-new-tokens", "4") for p in (adapter, tmp_path /
                                                                                             "merged")]
    assert all(o.returncode == 0 for o in outs) and outs[0].stdout == outs[1].stdout, [o.stderr[-2000:] for o in outs]

    first = sorted(base_dir.glob("model-*.safetensors"))[0]  # the base changed under the adapters, same shapes
    tensors = load_file(first)
    name = next(iter(tensors))
    save_file({**tensors, name: tensors[name].roll(1, 0)}, first, metadata={"format": "pt"})
    swapped = f"{base_dir}: the base weights are not those the adapters were trained on: {first.name} differs"
    refused = cli_in_process("export", str(ckpt), str(tmp_path / "merged-again"), "--merge")
    assert refused.returncode == 1 and f"CheckpointError: {swapped}" in refused.stderr, refused.stderr
    with pytest.raises(CheckpointError, match=re.escape(swapped)):
        ChatModel.load(adapter)
    assert not (tmp_path / "merged-again").exists()


def test_a_lora_run_is_not_continued_as_full_fine_tuning_nor_with_other_lora_settings(tmp_path):
    from raysft.launch.prelaunch import claim_run_dir

    changes = [("r", 4, 0), ("r", 0, 4), ("r", 4, 8), ("alpha", 8, 16), ("dropout", 0.0, 0.1),
               ("target_modules", "[q_proj, v_proj, down_proj]", "[q_proj, v_proj]")]
    for i, (key, first, then) in enumerate(changes):
        claim_run_dir(run_config(tmp_path, f"run{i}", **{**LORA, f"model.lora.{key}": first}), "data")
        claim_run_dir(run_config(tmp_path, f"run{i}", **{**LORA, f"model.lora.{key}": first}), "data")  # continues
        with pytest.raises(ConfigError, match="model.lora must match"):
            claim_run_dir(run_config(tmp_path, f"run{i}", **{**LORA, f"model.lora.{key}": then}), "data")


def _save_base(path: Path, seed: int) -> Path:
    tokenizer = load_tokenizer(ModelConfig(), "auto")
    build_full_model(ModelConfig(), load_model_config(ModelConfig(), tokenizer), seed=seed).save_pretrained(
        path, max_shard_size="2MB")
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("lora_r", [4, 0], ids=["lora", "full_fine_tuning"])
def test_a_relaunch_on_other_weights_of_the_same_shapes_at_model_path_is_refused_naming_the_file(tmp_path, lora_r):
    """The run's identity pins its base by a fingerprint of model.path's files (size, header, sampled bytes of
    every tensor): the same weights copied back (new mtimes) continue; one tensor changed, or the whole base
    replaced by another of the same shapes, is refused naming the run, model.path and the files, with --fresh."""
    import os
    import shutil

    from raysft.launch.prelaunch import claim_run_dir

    base, other = _save_base(tmp_path / "base", seed=3), _save_base(tmp_path / "other", seed=4)
    files = sorted(p.name for p in base.glob("*.safetensors"))
    assert len(files) >= 2 and files == sorted(p.name for p in other.glob("*.safetensors"))
    cfg = run_config(tmp_path, "run", **{**LORA, "model.lora.r": lora_r, "model.path": str(base)})
    claim_run_dir(cfg, "data")
    for name in files:  # the same bytes again, with new mtimes: the same base
        shutil.copy(base / name, tmp_path / name)
        shutil.move(tmp_path / name, base / name)
        os.utime(base / name, (1, 1))
    claim_run_dir(cfg, "data")
    refused = (f"run 'run' in {cfg.run_dir} exists and the weights at model.path {base} are not those it started "
               "from: {}.*--fresh")
    middle = base / files[1]
    tensors = load_file(middle)
    name = next(iter(tensors))
    save_file({**tensors, name: tensors[name].roll(1, 0)}, middle, metadata={"format": "pt"})  # same shape, header
    with pytest.raises(ConfigError, match=refused.format(f"{files[1]} differs")):
        claim_run_dir(cfg, "data")
    for name in files:  # another model of the same shapes in its place
        shutil.copy(other / name, base / name)
    with pytest.raises(ConfigError, match=refused.format(", ".join(f"{n} differs" for n in files))):
        claim_run_dir(cfg, "data")
    assert claim_run_dir(cfg, "data", fresh=True)  # started over on the new base, the old run kept
    claim_run_dir(cfg, "data")
