"""Real Ray Train, real FSDP2 over gloo with 2 workers, real files: training, checkpoint, export, resume."""

import json
from pathlib import Path

import pytest
import torch
from conftest import run_workers, tiny_config
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import raysft
from raysft.checkpoint import save
from raysft.config import TrainConfig
from raysft.data import prepare_store
from raysft.launch import CannotPlaceWorkers, ray_report, ray_worker_context
from raysft.metrics import read_metrics
from raysft.tokenizer import load_tokenizer
from raysft.trainer import Trainer

pytestmark = pytest.mark.usefixtures("ray_cluster")
PROBE = torch.tensor([[5, 60, 70, 80, 90, 100, 3, 4], [7, 8, 9, 10, 11, 12, 13, 14]])


def store_for(cfg: TrainConfig) -> Path:
    return prepare_store(cfg.data, load_tokenizer(cfg.model, cfg.data.chat_template), cfg.store_dir).path


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in run_dir.glob("checkpoint_*") if p.is_dir())


def test_two_workers_lower_the_loss_and_resume_by_run_name(tmp_path):
    cfg = tiny_config(tmp_path, **{"train.max_steps": 40, "checkpoint.every_n_steps": 20})
    result = raysft.train(cfg)
    steps = [m for m in read_metrics(cfg.run_dir) if "step" in m and "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 41))
    first, last = [sum(m["loss"] for m in part) / 5 for part in (steps[:5], steps[-5:])]
    assert last < 0.6 * first, (first, last)
    assert all(m["tokens"] > 0 and m["mfu"] is None for m in steps)  # no known peak on a CPU
    assert 0 < steps[-2]["eta_s"] and "eta_s" not in steps[0]  # the ETA needs one step's duration
    saves = [m for m in read_metrics(cfg.run_dir) if m.get("event") == "checkpoint"]
    ckpt_bytes = sum(f.stat().st_size for f in Path(result.checkpoint.path).iterdir())
    assert [m["step"] for m in saves] == [20, 40] and saves[-1]["gb"] == pytest.approx(ckpt_bytes / 1e9, abs=1e-4)
    assert saves[-1]["gb_per_s"] == pytest.approx(saves[-1]["gb"] / saves[-1]["save_s"], rel=0.05)
    assert Path(result.checkpoint.path).name == "checkpoint_00000040"
    assert checkpoint_steps(cfg.run_dir) == [20, 40]
    ckpt = Path(result.checkpoint.path)
    assert {"model.safetensors", "config.json", "optimizer.safetensors", "rng.safetensors",
            "trainer_state.json", "tokenizer.json"} <= {p.name for p in ckpt.iterdir()}
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 40 and state["cursor"] == {"seed": 0, "epoch": 0, "consumed": 640}

    # Launching the same run again (same name and storage) continues from step 40 instead of starting over.
    longer = tiny_config(tmp_path, **{"train.max_steps": 50, "checkpoint.every_n_steps": 20})
    result = raysft.train(longer)
    records = read_metrics(cfg.run_dir)
    resume = [r for r in records if r.get("event") == "resume"]
    assert len(resume) == 1 and resume[0]["step"] == 40
    after = [r["step"] for r in records[records.index(resume[0]):] if "loss" in r]
    assert after == list(range(41, 51))
    assert Path(result.checkpoint.path).name == "checkpoint_00000050"


def _train_then_probe(loop: dict) -> None:
    cfg = TrainConfig.from_dict(loop["config"])
    ctx = ray_worker_context()
    trainer = Trainer(cfg, Path(loop["store"]), None, ray_report, ctx)
    trainer.train()
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(input_ids=PROBE).logits
    if ctx.rank == 0:
        save_file({"logits": logits.contiguous()}, loop["out"])


def test_export_has_the_trained_logits_and_fine_tunes_via_model_path(tmp_path):
    cfg = tiny_config(tmp_path, **{"train.max_steps": 10})
    result = run_workers(_train_then_probe, {"config": cfg.to_dict(), "store": str(store_for(cfg)),
                                             "out": str(tmp_path / "live.safetensors")}, tmp_path)
    out = raysft.export(result.checkpoint.path, tmp_path / "hf")
    assert not any(n in {p.name for p in out.iterdir()} for n in ("optimizer.safetensors", "trainer_state.json"))
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert model.config.use_cache  # generation from the export uses the KV cache
    with torch.no_grad():
        exported = model(input_ids=PROBE).logits
    live = load_file(tmp_path / "live.safetensors")["logits"]
    torch.testing.assert_close(exported, live, rtol=1e-5, atol=1e-5)
    with pytest.raises(FileExistsError):
        raysft.export(result.checkpoint.path, tmp_path / "hf")

    # Fine-tuning from the exported directory starts from its weights (and its tokenizer), not a fresh init:
    # the first step's loss (computed before the update) is far below that of a from-scratch run.
    tuned = tiny_config(tmp_path, **{"model.path": str(out), "model.tokenizer": "", "train.max_steps": 2,
                                     "run.name": "tuned"})
    raysft.train(tuned)
    first_loss = {run: next(m["loss"] for m in read_metrics(c.run_dir) if m.get("step") == 1)
                  for run, c in (("scratch", cfg), ("tuned", tuned))}
    assert first_loss["tuned"] < first_loss["scratch"] - 1.0, first_loss


def _resume_then_save(loop: dict) -> None:
    cfg = TrainConfig.from_dict(loop["config"])
    trainer = Trainer(cfg, Path(loop["store"]), Path(loop["resume"]), ray_report, ray_worker_context())
    save(Path(loop["out"]) / f"rank{trainer.ctx.rank}", "full", trainer.objs, trainer.state)


def test_resume_restores_model_optimizer_schedule_cursor_and_rng(tmp_path):
    cfg = tiny_config(tmp_path, **{"train.max_steps": 10, "checkpoint.every_n_steps": 5})
    raysft.train(cfg)
    saved = cfg.run_dir / "checkpoint_00000005"
    resaved = tmp_path / "resaved" / "rank0"  # a full checkpoint is all on rank 0
    run_workers(_resume_then_save, {"config": cfg.to_dict(), "store": str(store_for(cfg)), "resume": str(saved),
                                    "out": str(resaved.parent)}, tmp_path)
    for name in ("model.safetensors", "optimizer.safetensors", "rng.safetensors"):
        a, b = load_file(saved / name), load_file(resaved / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert json.loads((saved / "optimizer.json").read_text()) == json.loads((resaved / "optimizer.json").read_text())
    before, after = (json.loads((d / "trainer_state.json").read_text()) for d in (saved, resaved))
    assert after == before and before["step"] == 5 and before["scheduler"]["last_epoch"] == 5


def test_a_cluster_that_cannot_place_the_workers_is_an_error(tmp_path):
    cfg = tiny_config(tmp_path, **{"scaling.num_workers": 8, "train.global_batch_size": 32})
    with pytest.raises(CannotPlaceWorkers, match="scaling.num_workers=8"):
        raysft.train(cfg)
