"""The documented DPO path as a newcomer runs it: docs/DPO.md's commands, `make demo` and then `raysft train
jobs/configs/demo-dpo.yaml --export runs/demo-dpo-model`, typed in a copy of the repository as a fresh clone has it,
with the config's relative model.path (runs/demo-model) and ~/raysft_runs in a scratch HOME.

`make demo`'s training runs as the torchrun entry typed in the copy (the suite's gloo pair runs raysft.run's launch
there) and its export goes where the Makefile's recipe puts it; the DPO config then trains under the torchrun entry,
and under Ray as the docs type it: the CLI with its own local Ray, whose workers run in a directory of Ray's, not
the copy (they had looked for runs/demo-model there, and Ray had retried them into the same error). The two DPO runs
share the store and the reference log-probabilities the first computed. `raysft plan` and `raysft chat` with the
same relative paths read the same directories. Without `make demo` the DPO command is a config error naming
model.path, before Ray starts."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, cli_env, cli_in_process
from safetensors.torch import load_file

from raysft.config import load_config
from raysft.training.metrics import read_metrics

REWARDS = {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected"}
SFT = ["train.max_steps=6", "checkpoint.every_n_steps=6", "data.max_seq_len=96", "train.warmup_steps=2"]
DEMO_DPO = ["train.max_steps=4", "checkpoint.every_n_steps=4", "data.max_seq_len=96", "train.log_every_n_steps=2"]


def fresh_clone(dest: Path) -> Path:
    """The repository's files as a fresh clone of this checkout, committed, has them (those git tracks and those it
    would, as they are here): no .venv, no runs/, nothing else git ignores. Ray's processes import raysft from
    there too (Ray puts the driver's directory on their path)."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    for name in filter(None, listed.stdout.split("\0")):
        if (REPO / name).is_file():  # not one deleted in the working tree
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def docs_commands() -> list[str]:
    """docs/DPO.md's first bash block, a command a line, comments dropped."""
    block = (REPO / "docs" / "DPO.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def make_demo_recipe() -> list[str]:
    """What `make demo` runs, its venv's raysft written `raysft`."""
    recipe = re.search(r"^demo:.*\n\t(.+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    return shlex.split(recipe.replace("$(BIN)/raysft", "raysft"))


def raysft_command() -> list[str]:
    """The `raysft` console script of this interpreter's environment, which imports the raysft under test wherever
    it runs (`python -m raysft` in the clone would import the clone's copy)."""
    script = Path(sys.executable).with_name("raysft")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "raysft"]


def torchrun_in(ctx, cwd: Path, home: Path, config: str, overrides: list[str]) -> int:
    """`torchrun ... -m raysft.run CONFIG --set ...` typed in `cwd` with HOME=home, on this rank: the entry's launch
    (raysft.launch.torchrun.run_launch) and its exit code."""
    from raysft.launch.torchrun import run_launch

    before, home_before = os.getcwd(), os.environ.get("HOME")
    os.chdir(cwd)
    os.environ["HOME"] = str(home)
    try:
        return run_launch(ctx, config, overrides)[0]
    finally:
        os.chdir(before)
        if home_before is None:
            os.environ.pop("HOME", None)
        else:
            os.environ["HOME"] = home_before


def test_the_dpo_demo_without_make_demo_is_a_config_error_naming_model_path_before_ray_starts(tmp_path,
                                                                                                monkeypatch):
    clone, home = fresh_clone(tmp_path / "clone"), tmp_path / "home"
    monkeypatch.chdir(clone)
    monkeypatch.setenv("HOME", str(home))
    out = cli_in_process(*shlex.split(docs_commands()[1])[1:])  # asserts that no Ray was started
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [f"raysft: config error: config key 'model.path': {clone}/runs/demo-model "
                                       f"does not exist (a relative path is taken from {clone}, where the command "
                                       "runs)"], out.stderr
    assert not home.exists()  # no store tokenized, no run claimed


@pytest.mark.slow  # a real raysft train on a local Ray
def test_the_docs_dpo_commands_from_a_fresh_clone_under_torchrun_and_under_ray(tmp_path, gloo_pool, monkeypatch):
    clone, home = fresh_clone(tmp_path / "clone"), tmp_path / "home"
    make_demo, dpo = docs_commands()
    demo = make_demo_recipe()
    assert make_demo == "make demo" and demo[:3] == ["raysft", "train", "jobs/configs/demo.yaml"], (make_demo, demo)
    export = demo[demo.index("--export") + 1]
    assert load_config(clone / "jobs/configs/demo-dpo.yaml").model.path == export == "runs/demo-model"

    # make demo: its training, typed in the clone, then its export where the recipe's --export puts it
    assert gloo_pool.run(torchrun_in, clone, home, demo[2], SFT) == [0, 0]
    monkeypatch.chdir(clone)
    monkeypatch.setenv("HOME", str(home))
    exported = cli_in_process("export", str(home / "raysft_runs" / "demo"), export)
    assert exported.returncode == 0, exported.stderr

    config = shlex.split(dpo)[2]
    assert gloo_pool.run(torchrun_in, clone, home, config, [*DEMO_DPO, "run.name=demo-dpo-torchrun"]) == [0, 0]
    with cli_env() as env:  # the docs' command, shrunk, where a newcomer types it
        out = subprocess.run([*raysft_command(), *shlex.split(dpo)[1:], *[a for s in DEMO_DPO for a in ("--set", s)]],
                             cwd=clone, env={**env, "HOME": str(home)}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"raysft: exported {clone}/runs/demo-dpo-model" in out.stdout, out.stdout[-3000:]
    runs = {name: home / "raysft_runs" / f"demo-dpo{suffix}" for name, suffix in (("torchrun", "-torchrun"),
                                                                                   ("ray", ""))}
    for run in runs.values():  # resolved where the command was typed, once, on the driver (rank 0)
        assert json.loads((run / "raysft_run.json").read_text())["model.path"] == f"{clone}/runs/demo-model"
    records = {name: read_metrics(run) for name, run in runs.items()}
    for rows in records.values():
        steps = [m for m in rows if "loss" in m]
        assert [m["step"] for m in steps] == [1, 2, 3, 4] and REWARDS <= set(steps[0])
        # the policy starts as its reference, the SFT export (to rounding: the pass padded other batches)
        assert steps[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    # the pass ran once, on the first launch; the Ray run found its file (same store, same starting model)
    reference = {name: [m for m in rows if m.get("event") == "reference_logps"] for name, rows in records.items()}
    assert "seconds" in reference["torchrun"][0] and reference["ray"][0]["reused"] is True
    assert reference["ray"][0]["file"] == reference["torchrun"][0]["file"]
    # both trained the same floats from the same start on the same batches
    loss = {name: [m["loss"] for m in rows if "loss" in m] for name, rows in records.items()}
    assert loss["torchrun"] == pytest.approx(loss["ray"], rel=1e-6)
    tuned, start = load_file(clone / "runs/demo-dpo-model/model.safetensors"), load_file(clone / export /
                                                                                         "model.safetensors")
    assert tuned.keys() == start.keys() and any(not (tuned[k] == start[k]).all() for k in tuned)

    # plan and chat take the same relative paths to the same directories
    planned = cli_in_process("plan", config)
    assert planned.returncode == 0, planned.stderr
    assert f"raysft: architecture from {clone}/runs/demo-model/config.json (model.path)" in planned.stdout
    answer = cli_in_process("chat", "runs/demo-dpo-model", "--prompt", "What is the capital of France?")
    assert answer.returncode == 0 and answer.stdout.strip(), answer.stderr
