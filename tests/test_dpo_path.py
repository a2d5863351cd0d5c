"""The whole DPO path: SFT, its export, then `raysft train` with a DPO config from that export, under the torchrun
entry (the gloo pool runs raysft.run's launch) and under Ray (the CLI, its own local Ray), both through
jobs/configs/demo-dpo.yaml. The two share the store and the reference log-probabilities the first computed."""

import pytest
from conftest import REPO, cli_env, run_cli, tiny_config
from safetensors.torch import load_file

import raysft
from raysft.checkpoint import checkpoint_dirs
from raysft.config import load_config
from raysft.launch.torchrun import launch
from raysft.training.metrics import read_metrics

REWARDS = {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected"}
DEMO_DPO = ["train.max_steps=4", "checkpoint.every_n_steps=4", "data.max_seq_len=96", "train.log_every_n_steps=2"]


@pytest.mark.slow  # a real raysft train on a local Ray
def test_dpo_from_an_sft_export_under_torchrun_and_under_ray(tmp_path, gloo_pool):
    sft = tiny_config(tmp_path, **{"train.max_steps": 6, "checkpoint.every_n_steps": 6, "run.name": "sft"})
    gloo_pool.run(launch, sft)
    export = tmp_path / "sft-model"
    raysft.export(checkpoint_dirs(sft.run_dir)[-1], export)

    sets = [*DEMO_DPO, f"model.path={export}", f"run.storage_path={tmp_path / 'runs'}"]
    torchrun = load_config(REPO / "jobs/configs/demo-dpo.yaml", [*sets, "run.name=dpo-torchrun"])
    gloo_pool.run(launch, torchrun)
    with cli_env() as env:
        out = run_cli("train", "jobs/configs/demo-dpo.yaml", *[a for s in sets for a in ("--set", s)],
                      "--set", "run.name=dpo-ray", "--export", str(tmp_path / "dpo-model"), env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    on_ray = load_config(REPO / "jobs/configs/demo-dpo.yaml", [*sets, "run.name=dpo-ray"])
    runs = {name: read_metrics(cfg.run_dir) for name, cfg in (("torchrun", torchrun), ("ray", on_ray))}
    for records in runs.values():
        steps = [m for m in records if "loss" in m]
        assert [m["step"] for m in steps] == [1, 2, 3, 4] and REWARDS <= set(steps[0])
        # the policy starts as its reference, the SFT export (to rounding: the pass padded other batches)
        assert steps[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    # the pass ran once, on the first launch; the Ray run found its file (same store, same starting model)
    reference = {name: [m for m in records if m.get("event") == "reference_logps"] for name, records in runs.items()}
    assert "seconds" in reference["torchrun"][0] and reference["ray"][0]["reused"] is True
    assert reference["ray"][0]["file"] == reference["torchrun"][0]["file"]
    # both trained the same floats from the same start on the same batches
    loss = {name: [m["loss"] for m in records if "loss" in m] for name, records in runs.items()}
    assert loss["torchrun"] == pytest.approx(loss["ray"], rel=1e-6)
    tuned, start = load_file(tmp_path / "dpo-model" / "model.safetensors"), load_file(export / "model.safetensors")
    assert tuned.keys() == start.keys() and any(not (tuned[k] == start[k]).all() for k in tuned)
