"""The Checkpointer and its sinks under plain torch.distributed (a reused pair of gloo processes, no Ray): async
saves, failed saves, streaming export."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import run_config
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from transformers import AutoModelForCausalLM

import raysft
from raysft.checkpoint import (
    MANIFEST_FILE,
    STAGING_DIR,
    CheckpointError,
    DirectorySink,
    auto_mode,
    checkpoint_dirs,
    incomplete_reason,
)
from raysft.data import prepare_store
from raysft.data.tokenizer import load_tokenizer
from raysft.hf.shards import MODEL_INDEX
from raysft.launch.torchrun import launch
from raysft.training.trainer import Trainer


def test_export_streams_shards_with_an_index_that_transformers_loads(tmp_path, gloo_pool):
    """A sharded checkpoint exported in shards of at most 1 MiB: safetensors shards + index, same weights."""
    cfg = run_config(tmp_path, "shards", **{"checkpoint.mode": "sharded", "train.max_steps": 3})
    gloo_pool.run(launch, cfg)
    out = raysft.export(cfg.run_dir / "checkpoint_00000003", tmp_path / "hf", max_shard_bytes=2**20)
    index = json.loads((out / MODEL_INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((out / s).stat().st_size <= 2**20 + 2**16 for s in shards)
    assert not any(p.suffix == ".distcp" or p.name in ("trainer_state.json", MANIFEST_FILE) for p in out.iterdir())
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    merged = {}
    for s in shards:
        merged.update(load_file(out / s))
    assert set(merged) == set(model.state_dict())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in merged.items())


def _async_saves(ctx, cfg, store: Path, out: Path) -> tuple[str, str]:
    """Async saves hold the state of the step they were asked for while training goes on, and a write that fails
    in the background fails the save on every rank and leaves nothing of it behind."""
    import raysft.checkpoint.full as ckpt_module

    trainer = Trainer(cfg, store, None, DirectorySink(cfg.run_dir, ctx.rank), ctx)
    checkpointer = trainer.checkpointer
    trainer.model.train()
    for mode in ("sharded", "full"):
        checkpointer.mode = mode
        metrics = trainer.train_step()
        expected = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True,
                                                                                cpu_offload=True))
        if ctx.rank == 0:
            save_file({k: v.contiguous() for k, v in expected.items()}, out / f"expected-{trainer.state.step}.st")
        checkpointer.save(trainer.state, metrics)
        assert checkpointer.pending[1]["step"] == trainer.state.step  # still being written
        trainer.train_step()
        trainer.train_step()  # the weights move on
        checkpointer.finish()
        dist.barrier()

    original = ckpt_module.write_safetensors

    def failing_write(path, tensors, metadata=None, only=None):
        if Path(path).name == "model.safetensors":
            raise OSError("No space left on device (injected)")
        return original(path, tensors, metadata, only)

    if ctx.rank == 0:
        ckpt_module.write_safetensors = failing_write
    try:
        checkpointer.save(trainer.state, trainer.train_step())
        trainer.train_step()
        checkpointer.finish()
    except CheckpointError as e:
        failed_save = str(e)
    else:
        failed_save = "no error"
    finally:
        ckpt_module.write_safetensors = original
    # a full checkpoint that rank 0 cannot read fails the load on every rank (the others used to wait in the
    # broadcast of its shards until the collective timeout)
    unreadable = out / "unreadable"
    if ctx.rank == 0:
        shutil.copytree(cfg.run_dir / "checkpoint_00000004", unreadable)
        with open(unreadable / "model.safetensors", "r+b") as f:
            f.truncate(100)
    dist.barrier()
    try:
        checkpointer.load(unreadable)
    except CheckpointError as e:  # any other error fails the task on its rank
        return failed_save, f"{type(e).__name__}: {e}"
    return failed_save, "loaded"


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_async_save_keeps_its_step_and_a_failed_save_leaves_nothing(tmp_path, gloo_pool):
    cfg = run_config(tmp_path, "async", **{"checkpoint.async": True})
    store = prepare_store(cfg.data, load_tokenizer(cfg.model, cfg.data.chat_template), cfg.store_dir).path
    cfg.run_dir.mkdir(parents=True)
    outcomes = gloo_pool.run(_async_saves, cfg, store, tmp_path)
    for mode, step in (("sharded", 1), ("full", 4)):
        expected = load_file(tmp_path / f"expected-{step}.st")
        raysft.export(cfg.run_dir / f"checkpoint_{step:08d}", tmp_path / f"hf-{mode}")
        weights = load_file(tmp_path / f"hf-{mode}" / "model.safetensors")
        assert weights.keys() == expected.keys()
        assert all(torch.equal(weights[k], expected[k]) for k in weights), mode
    for message, _ in outcomes:
        assert "writing the checkpoint of step 7 failed on 1 rank(s)" in message, message
    assert "No space left on device (injected)" in outcomes[0][0]
    cut_off = tmp_path / "unreadable" / "model.safetensors"  # rank 0's own reader names the file it cannot read
    assert outcomes[0][1].startswith(f"CheckpointError: {cut_off}: cannot read: "), outcomes[0]
    assert outcomes[1][1] == (f"CheckpointError: {tmp_path / 'unreadable'}: rank 0 could not read the full checkpoint: "
                              f"{outcomes[0][1].split(': ', 1)[1]}")
    # the failed save is gone whole; the previous checkpoint is still the latest and complete
    assert [p.name for p in checkpoint_dirs(cfg.run_dir)] == ["checkpoint_00000001", "checkpoint_00000004"]
    assert not (cfg.run_dir / STAGING_DIR).exists() or not any((cfg.run_dir / STAGING_DIR).iterdir())
    assert incomplete_reason(cfg.run_dir / "checkpoint_00000004") is None


@pytest.mark.parametrize("state_gb, available_gb, workers, asynchronous, mode", [
    (1, 64, 8, False, "full"),
    (16, 64, 8, False, "full"),        # at the limit of what rank 0 writes alone
    (17, 512, 8, False, "sharded"),    # past it, however much memory rank 0 has
    (96, 2048, 16, False, "sharded"),  # Llama-3.1-8B on 16 workers: 16 writers instead of one
    (168, 512, 1, False, "full"),      # one worker writes everything either way
    (10, 32, 8, False, "full"),        # synchronous: one tensor at a time on rank 0, not the whole state
    (10, 32, 8, True, "sharded"),      # async gathers the whole state on rank 0: a quarter of its memory
    (4, 64, 8, True, "full"),
])
def test_auto_mode_shards_what_rank_0_would_write_alone_or_hold_whole_for_async(state_gb, available_gb, workers,
                                                                               asynchronous, mode):
    assert auto_mode(state_gb * 2**30, available_gb * 2**30, workers, asynchronous) == mode


def test_safetensors_written_from_memory_read_back_by_safetensors_with_the_hash_of_the_file(tmp_path):
    import hashlib

    from safetensors.torch import load_file

    from raysft.checkpoint.full import write_safetensors

    tensors = {"w": torch.randn(3, 5), "bf16": torch.randn(7).bfloat16(), "scalar": torch.tensor(3),
               "empty": torch.zeros(0, 4), "mask": torch.tensor([True, False]), "ids": torch.arange(5)}
    digest = write_safetensors(tmp_path / "x.safetensors", tensors, {"format": "pt"})
    back = load_file(tmp_path / "x.safetensors")
    assert back.keys() == tensors.keys()
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in tensors.items())
    assert digest == hashlib.sha256((tmp_path / "x.safetensors").read_bytes()).hexdigest()


def _full_state(trainer) -> dict[str, object]:
    """The whole model and optimizer state, flat by name (every rank gathers; rank 0 holds it, the others nothing)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    flat = {f"model/{k}": v for k, v in get_model_state_dict(trainer.model, options=options).items()}
    optim = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=options)
    for fqn, state in optim.get("state", {}).items():
        flat.update({f"optim/{fqn}/{k}": v for k, v in state.items()})
    flat["param_groups"] = optim.get("param_groups")
    return flat


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k] for k, v in a.items())


def _split_full_saves(ctx, cfg, store: Path, out: Path) -> tuple[bool, bool, str]:
    """A full checkpoint saved in files of at most 256 KiB, gathered in blocks of 4 KiB, and one saved in a single
    file (the layout of every earlier full checkpoint), gathered a tensor at once, each resume to the state that was
    saved; an index that puts a tensor in another file is refused."""
    import raysft.checkpoint.full as full
    import raysft.hf.shards as hf_shards

    trainer = Trainer(cfg, store, None, DirectorySink(cfg.run_dir, ctx.rank), ctx)
    checkpointer = trainer.checkpointer
    checkpointer.mode = "full"
    trainer.model.train()
    saved = {}
    for step, shard_bytes, gather_bytes in ((2, 2**18, 2**12), (3, hf_shards.SHARD_BYTES, full.GATHER_BYTES)):
        while trainer.state.step < step:
            metrics = trainer.train_step()
        saved[step] = _full_state(trainer)
        if ctx.rank == 0:
            save_file({k.removeprefix("model/"): v.contiguous() for k, v in saved[step].items()
                       if k.startswith("model/")}, out / f"expected-{step}.st")
        defaults = hf_shards.SHARD_BYTES, full.GATHER_BYTES
        hf_shards.SHARD_BYTES, full.GATHER_BYTES = shard_bytes, gather_bytes
        try:
            checkpointer.save(trainer.state, metrics)
            checkpointer.finish()
        finally:
            hf_shards.SHARD_BYTES, full.GATHER_BYTES = defaults
    trainer.train_step()  # the state moves on
    resumed = {}
    for step in saved:
        checkpointer.load(cfg.run_dir / f"checkpoint_{step:08d}")
        resumed[step] = _same(_full_state(trainer), saved[step])
    misplaced = out / "misplaced"
    if ctx.rank == 0:
        shutil.copytree(cfg.run_dir / "checkpoint_00000002", misplaced)
        index = json.loads((misplaced / MODEL_INDEX).read_text())
        first, last = next(iter(index["weight_map"])), list(index["weight_map"])[-1]
        index["weight_map"][first] = index["weight_map"][last]
        (misplaced / MODEL_INDEX).write_text(json.dumps(index))
    dist.barrier()
    try:
        checkpointer.load(misplaced)
        refused = "loaded"
    except CheckpointError as e:
        refused = str(e)
    return resumed[2], resumed[3], refused


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_a_full_checkpoint_in_files_with_an_index_resumes_exports_and_loads_in_transformers(tmp_path, gloo_pool):
    """The model and optimizer files of a full checkpoint cut into groups (model-0000i-of-0000n.safetensors and
    its index, as HF writes a large model; optimizer likewise): every rank resumes its slices through the index
    to the state that was saved, transformers loads the directory as it is, export and chat read it, a file
    missing makes it incomplete; a single-file one (the earlier layout) resumes and exports as before."""
    from raysft.products.chat_model import ChatModel

    cfg = run_config(tmp_path, "split", **{"checkpoint.mode": "full"})
    store = prepare_store(cfg.data, load_tokenizer(cfg.model, cfg.data.chat_template), cfg.store_dir).path
    cfg.run_dir.mkdir(parents=True)
    outcomes = gloo_pool.run(_split_full_saves, cfg, store, tmp_path)
    assert [o[:2] for o in outcomes] == [(True, True)] * 2
    assert outcomes[0][2].startswith(f"{tmp_path / 'misplaced' / MODEL_INDEX}: tensor "), outcomes[0][2]
    assert "is not where the index says" in outcomes[0][2]
    assert outcomes[1][2].startswith(f"{tmp_path / 'misplaced'}: rank 0 could not read the full checkpoint: ")
    split, single = cfg.run_dir / "checkpoint_00000002", cfg.run_dir / "checkpoint_00000003"
    names = {p.name for p in split.iterdir()}
    for stem in ("model", "optimizer"):
        files = json.loads((split / f"{stem}.safetensors.index.json").read_text())["weight_map"].values()
        assert len(set(files)) > 2 and set(files) <= names and f"{stem}.safetensors" not in names
        assert all((split / f).stat().st_size <= 2**18 + 2**16 for f in set(files))
    assert {"model.safetensors", "optimizer.safetensors"} <= {p.name for p in single.iterdir()}
    assert not any(p.name.endswith(".index.json") for p in single.iterdir())
    for ckpt, step in ((split, 2), (single, 3)):
        expected = load_file(tmp_path / f"expected-{step}.st")
        loaded = AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True).state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in expected.items())
        exported = raysft.export(ckpt, tmp_path / f"hf-{step}")
        assert not any(p.name.startswith("optimizer") for p in exported.iterdir())
        weights = load_file(exported / "model.safetensors")
        assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in weights)
    chat = ChatModel.load(split)
    assert all(torch.equal(chat.model.state_dict()[k], v) for k, v in load_file(tmp_path / "expected-2.st").items())
    shard = sorted(split.glob("optimizer-*.safetensors"))[1]
    shard.unlink()
    assert incomplete_reason(split) == f"{shard.name} is missing"


def _resume_reads(ctx, run_dir: Path) -> dict:
    """find_resume_dir on every rank, counting the bytes this rank hashed."""
    from raysft.checkpoint import find_resume_dir
    from raysft.storage import Location

    read, real = [0], Location.sha256

    def counting(self):
        read[0] += self.size()
        return real(self)

    Location.sha256 = counting
    try:
        resume_dir, skipped = find_resume_dir(run_dir)
    finally:
        Location.sha256 = real
    return {"resume": str(resume_dir), "skipped": skipped, "read": read[0]}


def test_resume_shares_the_reading_of_the_checkpoint_over_the_ranks_and_every_rank_skips_a_tampered_one(
        tmp_path, gloo_pool):
    """Rank 0 alone used to hash every file of the checkpoint while the others waited in a broadcast: at 790 GiB,
    tens of minutes per fault. Each rank now hashes about half the bytes, and a file tampered in either half is
    found, the same reason on both ranks, and the resume falls back to the checkpoint before."""
    cfg = run_config(tmp_path, "shared", **{"checkpoint.mode": "sharded", "train.max_steps": 2,
                                            "checkpoint.every_n_steps": 1})
    gloo_pool.run(launch, cfg)
    latest = cfg.run_dir / "checkpoint_00000002"
    total = sum(e["size"] for e in json.loads((latest / MANIFEST_FILE).read_text())["files"].values())
    whole = gloo_pool.run(_resume_reads, cfg.run_dir)
    assert [r["resume"] for r in whole] == [str(latest)] * 2 and all(r["skipped"] == [] for r in whole)
    assert sum(r["read"] for r in whole) == total
    assert max(r["read"] for r in whole) < 0.6 * total  # each rank about half, not rank 0 all of it

    for shard in ("__0_0.distcp", "__1_0.distcp"):  # one in each rank's share (the two largest files)
        broken = cfg.run_dir.parent / f"broken-{shard}"
        shutil.copytree(cfg.run_dir, broken)
        data = bytearray((broken / latest.name / shard).read_bytes())
        data[-1] ^= 0xFF  # same size, other content
        (broken / latest.name / shard).write_bytes(bytes(data))
        after = gloo_pool.run(_resume_reads, broken)
        reason = f"{shard} does not match its sha256 in the manifest"
        assert [r["resume"] for r in after] == [str(broken / "checkpoint_00000001")] * 2, after
        assert all(r["skipped"] == [(str(broken / latest.name), reason)] for r in after), after


def test_files_are_shared_by_size_the_same_way_on_every_rank():
    from raysft.checkpoint.manifest import share_by_size

    files = {n: {"size": s} for n, s in [("a", 10), ("b", 70), ("c", 30), ("d", 30), ("e", 5)]}
    shares = share_by_size(files, list(files), 2)
    assert shares == [["b", "e"], ["a", "c", "d"]]  # 75 and 70 bytes, each share in manifest order
    assert share_by_size(files, list(files), 1) == [list(files)]
    assert share_by_size(files, ["a"], 3) == [["a"], [], []]
