"""The console script end to end, as a user runs it: exit codes, printed paths, a terminal's progress bar. Its
training joins the suite's Ray through RAY_ADDRESS; a `raysft train` that starts a local Ray of its own (its
"a local Ray of its own; its logs: ..." line, its processes gone after) is tests/test_signals.py's."""

import json
import os
import pty
import re
import subprocess
import sys

import pytest
from conftest import REPO, WITHOUT_RAY_TRAIN_EXTRAS, cli_in_process

from raysft.training.metrics import read_metrics


def on_a_terminal(*args: str, env: dict, stdout_file) -> tuple[int, str]:
    """`raysft ARGS` with stderr on a pseudo-terminal, as a user's shell runs it: its exit code and what the
    terminal showed. stdout goes to a file, so a full pipe cannot stall the child while the terminal is read."""
    controller, terminal = pty.openpty()
    with open(stdout_file, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "raysft", *args], cwd=REPO, env=env, stdout=out,
                                stderr=terminal)
    os.close(terminal)
    seen = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    os.close(controller)
    return proc.wait(timeout=600), seen.decode(errors="replace")


@pytest.mark.slow  # a real raysft train, on the suite's Ray
def test_train_on_a_terminal_draws_a_bar_then_exports_and_prompts(tmp_path, ray_head):
    # the cluster in RAY_ADDRESS, as a user of a running cluster has it: no local Ray's start and stop here. Ray
    # Train's defaults, as a user has them (conftest's WITHOUT_RAY_TRAIN_EXTRAS off): the preemption watcher's
    # default said explicitly, which Ray Train passes on to its controller over the suite's head's setting
    env = {**{k: v for k, v in os.environ.items() if k not in WITHOUT_RAY_TRAIN_EXTRAS},
           "RAY_ADDRESS": ray_head.address, "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "1"}
    code, terminal = on_a_terminal(
        "train", "jobs/configs/demo.yaml", "--set", "train.max_steps=6", "--set", "checkpoint.every_n_steps=3",
        "--set", "data.max_seq_len=96", "--set", f"run.storage_path={tmp_path}", "--set", "run.name=cli",
        "--set", "eval.max_samples=8",
        "--export", str(tmp_path / "hf"), "--prompt", "What is 2 plus 3?", env=env, stdout_file=tmp_path / "stdout")
    assert code == 0, terminal[-3000:]
    assert "\r\x1b[K" in terminal and "step 6/6" in terminal and "100%" in terminal and "| eta " in terminal
    # Ray Train's own INFO lines (each report's metrics dict, worker-group starts) stay in Ray's logs
    assert "TrainingReport(" not in terminal and "Requesting resources" not in terminal, terminal[-3000:]
    stdout = (tmp_path / "stdout").read_text()
    assert "raysft: checkpoint step=3 mode=" in stdout and "a local Ray of its own" not in stdout  # joined it
    assert f"raysft: latest checkpoint {tmp_path}/cli/checkpoint_00000006" in stdout
    assert "assistant:" in stdout and (tmp_path / "hf" / "model.safetensors").is_file()
    # make demo's closing line: the demo's eval set scored before training (the base, step 0) and after it, each
    # evaluation a Ray task of its own beside the workers
    assert re.search(r"raysft: generation eval \(builtin:demo-eval, 8 prompts\): step 0 \(the base\): "
                     r"gen/exact_match 0\.000, gen/contains 0\.000 -> step 6: gen/exact_match \d\.\d{3}", stdout), \
        stdout[-3000:]
    # step 3, saved while the base's evaluation may still run: evaluated, or skipped with a record (never lost)
    events = {m["step"]: m["event"] for m in read_metrics(tmp_path / "cli") if m.get("event", "").startswith("gen")}
    assert events[0] == events[6] == "gen_eval" and events[3] in ("gen_eval", "gen_eval_skipped"), events

    again = cli_in_process("export", str(tmp_path / "cli" / "checkpoint_00000003"), str(tmp_path / "hf3"))
    assert again.returncode == 0 and (tmp_path / "hf3" / "config.json").is_file(), again.stderr
    refused = cli_in_process("export", str(tmp_path / "cli" / "checkpoint_00000003"), str(tmp_path / "hf3"))
    assert refused.returncode == 1 and "not empty" in refused.stderr


def test_bad_data_fails_before_training_and_names_file_and_record(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                   '{"messages": [{"role": "wizard", "content": "hi"}]}\n')
    out = cli_in_process("train", "--set", f"data.paths=[{bad}]", "--set", f"run.storage_path={tmp_path}")
    assert out.returncode == 1
    assert f"{bad}: record 1: messages[0].role is 'wizard'" in out.stderr


def test_export_of_something_that_is_not_a_checkpoint_fails(tmp_path):
    out = cli_in_process("export", str(tmp_path), str(tmp_path / "out"))
    assert out.returncode == 1 and "trainer_state.json" in out.stderr


def test_prepare_writes_the_store_once_and_then_reuses_it(tmp_path):
    args = ("prepare", "jobs/configs/demo.yaml", "--set", f"run.storage_path={tmp_path}")
    first, second = cli_in_process(*args), cli_in_process(*args)
    assert first.returncode == 0 and "(written)" in first.stdout and "'samples': 1200" in first.stdout
    assert second.returncode == 0 and "(reused)" in second.stdout
    assert len(list((tmp_path / "datasets").glob("*/samples.parquet"))) == 1


def test_an_impossible_mesh_is_a_config_error_before_anything_runs(tmp_path):
    out = cli_in_process("train", "--set", "parallel.sharding=HYBRID_SHARD", "--set", "parallel.hsdp_shard_size=3",
                         "--set", "scaling.num_workers=4", "--set", "train.micro_batch_size=1",
                         "--set", f"run.storage_path={tmp_path}")
    assert out.returncode == 2
    assert "config error: config key 'parallel.hsdp_shard_size': shard-group size 3 does not divide" in out.stderr
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_a_second_launch_of_a_run_held_by_a_live_one_is_refused_before_anything_runs(tmp_path):
    import socket

    from raysft.launch.lease import LEASE_FILE, _start_time

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        run_dir = tmp_path / "busy"
        run_dir.mkdir()
        lease = {"host": socket.gethostname(), "pid": holder.pid, "started": _start_time(holder.pid),
                 "token": "first", "heartbeat": 0}
        (run_dir / LEASE_FILE).write_text(json.dumps(lease))
        out = cli_in_process("train", "--set", f"run.storage_path={tmp_path}", "--set", "run.name=busy", "--fresh")
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 1, out.stderr[-2000:]
    assert f"RunInUse: run directory {run_dir} is in use by another launch" in out.stderr
    assert f"pid {holder.pid}" in out.stderr and "raysft: run busy" not in out.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy"]  # refused first: nothing tokenized or moved
    assert json.loads((run_dir / LEASE_FILE).read_text()) == lease


def test_train_export_refuses_a_directory_it_did_not_export_before_training(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    out = cli_in_process("train", "--set", f"run.storage_path={tmp_path}", "--export", str(mine))
    assert out.returncode == 1 and f"{mine} exists and is not empty and is no raysft export" in out.stderr
    assert (mine / "notes.txt").read_text() == "keep me" and not (tmp_path / "raysft-demo").exists()
    into_run = cli_in_process("train", "--set", f"run.storage_path={tmp_path}", "--export", str(tmp_path), "--force")
    assert into_run.returncode == 1 and f"{tmp_path} holds the checkpoint being exported" in into_run.stderr
    assert not (tmp_path / "raysft-demo").exists()
