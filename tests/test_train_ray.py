"""Real Ray Train, real FSDP2 over gloo with 2 workers, real files: checkpoint scores and retention, validation
tasks beside training, a run-ending error, a cluster too small. A Ray run stopped and resumed by run name, equal to
the run without Ray: tests/test_checkpoint_ray.py. What needs no Ray (export, exact resume, packing) is in
tests/test_training.py."""

import contextlib
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from conftest import REPO, cli_in_process, tiny_config

import raysft
from raysft.checkpoint.gen_record import run_records
from raysft.checkpoint.retention import select_checkpoint
from raysft.config import ConfigError, TrainConfig
from raysft.data import prepare_store
from raysft.data.tokenizer import load_tokenizer
from raysft.launch.ray_driver import CannotPlaceWorkers
from raysft.training.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]
PROBE = torch.tensor([[5, 60, 70, 80, 90, 100, 3, 4], [7, 8, 9, 10, 11, 12, 13, 14]])


def store_for(cfg: TrainConfig) -> Path:
    return prepare_store(cfg.data, load_tokenizer(cfg.model, cfg.data.chat_template), cfg.store_dir).path


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in run_dir.glob("checkpoint_*") if p.is_dir())


def kill_the_evaluation_of(checkpoint: str, killed: list, stop: threading.Event) -> None:
    """SIGKILL the process of the checkpoint's evaluation task once it runs (as the OOM killer would)."""
    while not stop.is_set():
        for proc in psutil.process_iter(["cmdline"]):
            if any(f"raysft gen_eval {checkpoint}" in part for part in proc.info["cmdline"] or []):
                os.kill(proc.pid, signal.SIGKILL)
                killed.append(proc.pid)
                return
        time.sleep(0.05)


def move_away_once_resumed(run_dir: Path, path: Path) -> None:
    """Rename `path` aside once the run's second launch resumed (the driver has read it by then)."""
    while True:
        with contextlib.suppress(ValueError):  # a line being written
            if any(m.get("event") == "resume" for m in read_metrics(run_dir)):
                break
        time.sleep(0.05)
    path.rename(path.with_suffix(".gone"))


@pytest.fixture(scope="module")
def validated_run(tmp_path_factory):
    """One launch for the two tests of checkpoint scores under Ray (one Ray Train launch less in the suite): 6
    steps, a checkpoint every 2 with its eval loss (data.eval_fraction) and its generation score (an eval section:
    Ray's validation task), checkpoint.keep_best 1 by the eval loss; the process evaluating step 4 is killed while
    it runs. The second test launches it again."""
    tmp = tmp_path_factory.mktemp("validated")
    questions = [json.loads(line)["prompt"] for line in (REPO / "raysft/assets/demo/eval.jsonl").read_text()
                 .splitlines()[::5]]
    # What these 6 steps of 16 samples teach (train.lr 0.05): "................" at step 2, "TheTheThe..." at step 6;
    # the regex scorer tells them apart (any score that differs would do: it is what ranks the checkpoints below)
    eval_set = tmp / "eval.jsonl"
    eval_set.write_text("".join(json.dumps({"prompt": q, "answer": "TheThe"}) + "\n" for q in questions))
    sets = {"train.max_steps": 6, "checkpoint.every_n_steps": 2, "data.eval_fraction": 0.05, "checkpoint.keep_best": 1,
            "train.lr": 0.05, "train.global_batch_size": 16, "train.micro_batch_size": 4, "eval.path": str(eval_set),
            "eval.scorers": "[regex]", "eval.every_checkpoint": True,  # each one scored: the test compares them
            "eval.answer_pattern": "'^(TheThe)'", "eval.max_new_tokens": 16}
    killed, stop = [], threading.Event()
    killer = threading.Thread(target=kill_the_evaluation_of, args=("checkpoint_00000004", killed, stop), daemon=True)
    killer.start()
    try:
        result = raysft.train(tiny_config(tmp, **sets))
    finally:
        stop.set()
    return SimpleNamespace(tmp=tmp, sets=sets, result=result, cfg=tiny_config(tmp, **sets), killed=killed)


def test_ray_gets_the_eval_loss_with_each_checkpoint_and_keeps_the_best_and_the_latest(validated_run, tmp_path):
    """checkpoint.keep_best under Ray: Ray ranks the checkpoints by the eval_loss reported with them and prunes the
    run directory to the best and the latest, which is what raysft's own rule (and `export --checkpoint best`)
    reads from the checkpoints' trainer state."""
    cfg, result = validated_run.cfg, validated_run.result
    evals = {m["step"]: m["eval_loss"] for m in read_metrics(cfg.run_dir) if "eval_loss" in m}
    assert sorted(evals) == [2, 4, 6] and result.metrics["eval_loss"] == evals[6]
    assert min(evals, key=evals.get) == 2, evals  # the first evaluation is the best: best and latest differ
    assert checkpoint_steps(cfg.run_dir) == [2, 6]
    ray_best, score = min(result.best_checkpoints, key=lambda c: c[1]["eval_loss"])  # Ray's view: the same
    assert Path(ray_best.path).name == "checkpoint_00000002" and score["eval_loss"] == evals[2]
    assert Path(result.checkpoint.path).name == "checkpoint_00000006"
    assert select_checkpoint(cfg.run_dir, "best").name == "checkpoint_00000002"
    for picked, step in (("best", 2), ("latest", 6)):  # the CLI on the run Ray pruned
        out = cli_in_process("export", str(cfg.run_dir), str(tmp_path / picked), "--checkpoint", picked)
        assert out.returncode == 0, out.stderr[-2000:]
        assert json.loads((tmp_path / picked / "raysft_export.json").read_text())["step"] == step


def test_a_validation_task_scores_each_checkpoint_beside_training_a_relaunch_redoes_none_a_failure_goes_on(
        validated_run):
    """eval section under Ray: each checkpoint is scored by Ray's validation task on a CPU of its own while the
    workers train on, and the scores join Ray's checkpoint metrics (how Ray's keep_best ranks by them:
    tests/test_retention.py). The evaluation whose process is killed (step 4's) is one gen_eval_failed event naming
    it, and the run ends as it would have: Ray 2.60 alone ends it with a controller error. Launched again, the run
    redoes no evaluation that finished or failed, and its evaluations that fail (vLLM asked for where it is not
    installed) are one event each, leave their checkpoints without a score, and end nothing."""
    cfg, result = validated_run.cfg, validated_run.result
    assert len(validated_run.killed) == 1  # step 4's evaluation ran, and its process was killed
    assert [m["step"] for m in read_metrics(cfg.run_dir) if "loss" in m] == [1, 2, 3, 4, 5, 6]
    records = {name: record for name, kind, record in run_records(cfg.run_dir) if kind == "result"}
    scores = {r["step"]: r["metrics"]["gen/regex"] for r in records.values()}
    assert sorted(scores) == [2, 6]
    logged = [m for m in read_metrics(cfg.run_dir) if m.get("event") == "gen_eval"]
    assert sorted(e["step"] for e in logged) == [2, 6]
    lost = [m for m in read_metrics(cfg.run_dir) if m.get("event") == "gen_eval_failed"]
    assert [e["step"] for e in lost] == [4] and "the evaluation's process was lost" in lost[0]["reason"], lost
    assert all(e["gen/regex"] == scores[e["step"]] for e in logged)
    step_time = {m["step"]: m["time"] for m in read_metrics(cfg.run_dir) if "loss" in m}
    for r in records.values():  # the workers trained on while a checkpoint was scored: never on the step path
        assert r["step"] == 6 or step_time[r["step"] + 1] < r["finished"], (r["step"], step_time, r["finished"])
    for _, metrics in result.best_checkpoints:  # Ray's view: each score joined its checkpoint's metrics
        assert metrics.get("gen/regex") == scores.get(metrics["step"])

    assert scores[2] < scores[6], scores  # the scorer tells these checkpoints apart

    # an evaluation no node could ever start is refused before anything trains
    with pytest.raises(ConfigError, match=r"config key 'eval.num_gpus': 1, but no node of the Ray cluster has more "
                                          r"than 0 GPUs"):
        raysft.train(tiny_config(validated_run.tmp, **{**validated_run.sets, "train.max_steps": 10,
                                                       "eval.num_gpus": 1}))
    assert [m["step"] for m in read_metrics(cfg.run_dir) if "loss" in m] == [1, 2, 3, 4, 5, 6]

    relaunch = tiny_config(validated_run.tmp, **{**validated_run.sets, "train.max_steps": 10,
                                                 "train.schedule_steps": 10})  # a longer run, its LR laid out again
    eval_set = Path(relaunch.eval.path)
    mover = threading.Thread(target=move_away_once_resumed, args=(cfg.run_dir, eval_set), daemon=True)
    mover.start()  # the eval set gone from the node once the launch read it: its evaluations fail
    result = raysft.train(relaunch)
    mover.join()
    steps = [m["step"] for m in read_metrics(cfg.run_dir) if "loss" in m]
    assert steps[-4:] == [7, 8, 9, 10]  # training went on past the failed evaluation of step 8
    events = [m for m in read_metrics(cfg.run_dir) if m.get("event", "").startswith("gen_eval")]
    assert sorted((e["event"], e["step"]) for e in events) == [
        *[("gen_eval", s) for s in (2, 6)], *[("gen_eval_failed", s) for s in (4, 8, 10)]]
    failed = [e for e in events if e["event"] == "gen_eval_failed" and e["step"] > 6]
    assert all(f"eval.path: {eval_set} is not a file on node {socket.gethostname()}" in e["reason"]
               for e in failed), failed
    again = {name: record for name, _, record in run_records(cfg.run_dir)}
    assert all(again[name]["finished"] == record["finished"] for name, record in records.items())  # not redone
    ray_view = {metrics["step"]: metrics for _, metrics in result.best_checkpoints}
    assert "gen/regex" not in ray_view[10] and ray_view[10]["step"] == 10  # its failed evaluation added nothing


def test_the_vllm_processor_gets_the_prompt_tokens_of_the_hf_engine_and_stops_at_the_end_of_turn(validated_run):
    """The vLLM engine's Ray Data processor, built with Ray's API (vLLM is needed only to run it): no chat template,
    tokenize or detokenize stage of Ray's (its tokenize stage added a second BOS to the rendered template, its
    template stage dropped tools), each row the prompt's token ids as the hf engine renders them, tools included,
    and sampling that stops at the chat template's end of turn, which a full checkpoint has no generation config
    for."""
    from raysft.config import GenEvalConfig
    from raysft.data.labels import stop_token_ids
    from raysft.evals.engines import prompt_ids, tokenizer_and_stops, vllm_processor
    from raysft.evals.evalset import EvalSample

    ckpt = select_checkpoint(validated_run.cfg.run_dir, "latest")  # a full checkpoint: an HF directory
    tokenizer, stops = tokenizer_and_stops(ckpt)
    assert set(stop_token_ids(tokenizer)) <= set(stops)
    settings = GenEvalConfig(path="builtin:demo-eval", engine="vllm", num_gpus=1, max_new_tokens=8)
    processor = vllm_processor(str(ckpt), settings, stops)
    assert list(processor.stages) == ["vLLMEngineStage"]
    tool = {"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                             "parameters": {"type": "object", "properties": {}}}}
    sample = EvalSample(where="line 1", messages=[{"role": "user", "content": "What is 2 plus 3?"}], expected="5",
                        tools=[tool])
    ids = prompt_ids(tokenizer, sample)
    row = next(v for v in processor.preprocess({"index": 0, "ids": ids}).values())  # Ray's column of the row
    assert row["tokenized_prompt"] == ids and ids.count(tokenizer.bos_token_id) <= 1
    assert row["sampling_params"]["stop_token_ids"] == stops and row["sampling_params"]["max_tokens"] == 8
    # the prompt is what training tokenized before the answer it learned (the same template, the same tokens)
    from raysft.data.conversation import Conversation
    from raysft.data.labels import IGNORE_INDEX, label_conversation

    trained = label_conversation(tokenizer, Conversation([*sample.messages, {"role": "assistant", "content": "5"}],
                                                         [tool]), 1024)
    first_learned = next(i for i, label in enumerate(trained.labels) if label != IGNORE_INDEX)
    assert ids == trained.input_ids[:first_learned], (ids, trained.input_ids)


def test_an_evaluation_that_never_gets_its_resources_is_cancelled_and_recorded_as_timed_out(tmp_path, monkeypatch):
    """Ray's own timeout of a validation task counts from its submission and leaves no record: the validation
    function gives up first, on an evaluation with no result eval.timeout_s + RAY_GRACE_S / 2 after it was asked
    for (here one that asks for more CPUs than the cluster has, and waits), cancels it, and records why."""
    from dataclasses import asdict

    from ray.train import Checkpoint

    from raysft.checkpoint.gen_record import read_failure
    from raysft.config import GenEvalConfig
    from raysft.launch import ray_controller

    monkeypatch.setattr(ray_controller, "RAY_GRACE_S", 2.0)
    ckpt = tmp_path / "checkpoint_00000004"
    ckpt.mkdir()
    settings = asdict(GenEvalConfig(path="builtin:demo-eval", timeout_s=1.0))
    with pytest.raises(ray_controller.EvaluationLost, match="no result 2 s after it was asked for"):
        ray_controller.validate_checkpoint(Checkpoint(str(ckpt)), settings, resources={"num_cpus": 10_000})
    failure = read_failure(ckpt)
    assert failure["kind"] == "timed_out" and failure["step"] == 4, failure
    assert "waited that long for its resources (eval.num_cpus, eval.num_gpus)" in failure["reason"]


def test_the_validation_task_runs_on_the_controllers_node_and_its_process_death_is_retried(tmp_path):
    """Ray 2.60 ends the run when the validation task's own process or node dies (only an ordinary error or a
    cancel is the validation's end): the task is pinned, not softly, to the node Ray Train places the controller on,
    the driver's (its label selector in DataParallelTrainer), so losing that node ends nothing the controller's loss
    would not; its process killed alone, Ray starts it again (each start an attempt at the evaluation, bounded)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raysft.launch.ray_driver import gen_eval_validation

    options = gen_eval_validation(tiny_config(tmp_path, **{"eval.path": "builtin:demo-eval"})).ray_remote_kwargs
    where = options["scheduling_strategy"]
    assert isinstance(where, NodeAffinitySchedulingStrategy) and not where.soft
    assert where.node_id == ray.get_runtime_context().get_node_id()  # the driver's node: the controller's
    assert options["num_cpus"] == 0 and options["max_retries"] == 2


def test_a_cluster_that_cannot_place_the_workers_is_an_error(tmp_path):
    cfg = tiny_config(tmp_path, **{"scaling.num_workers": 8, "train.global_batch_size": 32})
    with pytest.raises(CannotPlaceWorkers, match="scaling.num_workers=8"):
        raysft.train(cfg)
