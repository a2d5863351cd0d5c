"""bench/gpu/check.py, the device check a session with a GPU runs first, run for real on CPU at toy size (--smoke):
every step in its own process, each recording its results, a failed step followed by the others all the same, and
nothing on the torchrun path importing Ray (the GPU machine has none). No timings are asserted."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import REPO
from test_fp8 import torchao_site

sys.path.insert(0, str(REPO / "bench" / "gpu"))
import check  # noqa: E402

pytestmark = pytest.mark.slow  # runs the whole device check (about 40 s): not in make test-fast
STEPS = ["environment", "tests", "prepare", "throughput", "profile", "determinism", "checkpoint"]
LEGS = ["bundle", "prepare", "save_memory", "titan"]
STEP_LEGS = ["prepare", "fp8", "memory_tier"]  # issue 47's, on the torchrun path
# The legs that start Ray (ray_throughput, ray_recovery, ray_sigterm, ray_lora) are left to the device call
# (docs/dev/DEVICE-CALLS.md): what each checks is the suite's elsewhere, on the same code under Ray
# (tests/test_checkpoint_ray.py's Ray run equal to the gloo one, tests/test_faults_cluster.py's killed workers
# resumed bit for bit, tests/test_signals.py, tests/test_lora.py)


def smoke_run(tmp, *args: str, env: dict | None = None) -> tuple[dict, dict, object]:
    """The check on CPU (no bundle: Ray and torchtitan as installed here): the summary, its steps by name, --out."""
    out = tmp / "out"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "check.py"), "--smoke", "--out", str(out),
                           "--work", str(tmp / "work"), "--bundle", str(tmp / "no-bundle"), *args],
                          cwd=tmp, capture_output=True, text=True, timeout=3300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    return summary, {s["name"]: s for s in summary["steps"]}, out


@pytest.fixture(scope="module")
def check_run(tmp_path_factory):
    """One smoke run of every step and leg the suite runs (a run of check.py costs a process start and the
    prepare step): the torchrun steps, whose tests step fails (a test id that does not exist); the legs a GPU session
    with the bundle runs for issue 39 without Ray (torchtitan's, the save's memory); and issue 47's
    (the memory tier's cost, FP8 against bf16, FP8 refused on a CPU). The bundle's torchao is on the path, as on the
    device (the suite's environment has none: tests/test_fp8.py)."""
    path = os.pathsep.join(filter(None, [str(torchao_site()), os.environ.get("PYTHONPATH")]))
    # the budget leaves time for a slow, shared machine
    return smoke_run(tmp_path_factory.mktemp("gpu-check"), "--only", ",".join(dict.fromkeys(STEPS + LEGS + STEP_LEGS)),
                     "--tests", "tests/test_gpu.py::test_that_does_not_exist", "--budget-s", "3000",
                     env={**os.environ, "PYTHONPATH": path})


def of(run, names: list[str]) -> tuple[dict, dict, object]:
    """The run's summary, its steps among names (in the order check.py ran them), its --out."""
    summary, steps, out = run
    return summary, {name: s for name, s in steps.items() if name in names}, out


@pytest.fixture(scope="module")
def smoke(check_run):
    return of(check_run, STEPS)


@pytest.fixture(scope="module")
def legs(check_run):
    return of(check_run, LEGS)


@pytest.fixture(scope="module")
def step_legs(check_run):
    return of(check_run, STEP_LEGS)


def test_a_failed_step_is_recorded_and_every_later_step_still_runs(smoke):
    summary, steps, _ = smoke
    assert list(steps) == STEPS
    assert steps["tests"]["status"] == "failed" and steps["tests"]["returncode"] != 0
    assert "test_that_does_not_exist" in steps["tests"]["log_tail"]
    assert all(steps[name]["status"] == "ok" for name in STEPS if name != "tests"), \
        {name: s.get("log_tail") for name, s in steps.items() if name != "tests"}
    assert all(s["seconds"] > 0 and s["timeout_s"] > 0 for s in steps.values())


def test_every_step_records_what_the_issue_asks_for(smoke):
    summary, steps, _ = smoke
    env = steps["environment"]["result"]
    assert env["packages"]["torch"] and env["safetensors_slice_reader"]["get_slice"] is True
    assert "importable" in env["flash_varlen"] and "gpu" not in env  # CPU here

    variants = steps["throughput"]["result"]["variants"]
    assert list(variants) == check.PLANS["smoke"]["variants"]
    for v in variants.values():
        assert v["status"] == "ok" and v["tokens_per_s"] > 0 and v["peak_mem_gib"] > 0
        assert v["computed_per_real_token"] >= 1
    # padding-free recipes compute on real tokens only; the padded ones on some padding as well
    assert variants["varlen"]["computed_per_real_token"] == variants["lora"]["computed_per_real_token"] == 1.0
    assert variants["padded"]["computed_per_real_token"] > 1.0
    # the token budget: each tried, the fastest kept, and the later varlen recipes trained with it
    tried = variants["varlen"]["budgets"]
    assert [b["micro_batch_tokens"] for b in tried] == [128, 256] and all(b["tokens_per_s"] > 0 for b in tried)
    chosen = steps["throughput"]["result"]["micro_batch_tokens"]
    assert chosen == max(tried, key=lambda b: b["tokens_per_s"])["micro_batch_tokens"]
    assert variants["varlen"]["micro_batch_tokens"] == variants["lora"]["micro_batch_tokens"] == chosen
    assert variants["full-logits"]["loss"] == pytest.approx(variants["padded"]["loss"], rel=1e-4)  # same training

    profile = steps["profile"]["result"]
    assert profile["variant"] == max(variants, key=lambda v: variants[v]["tokens_per_s"])
    assert 0 < profile["summary"]["busy_fraction"] <= 1 and profile["summary"]["top"][0]["self_ms"] > 0

    det = steps["determinism"]["result"]
    assert det["resume_bit_identical"] is True and det["same_steps_twice"] is True
    assert det["first_difference"] is None and det["same_final_checkpoint_files"] is True

    for name in ("full", "lora"):
        ckpt = steps["checkpoint"]["result"][name]
        assert ckpt["loaded_step"] == ckpt["saved_step"] and ckpt["bytes"] > 0
        assert sorted(r["async"] for r in ckpt["runs"]) == [False, True] and ckpt["async_blocking_over_sync_save"] > 0
    assert steps["checkpoint"]["result"]["lora"]["bytes"] < steps["checkpoint"]["result"]["full"]["bytes"]

    # the torchrun path: the GPU machine has no Ray
    assert not any(steps[name]["result"]["ray_imported"] for name in ("prepare", *check.TRAINING) if name in steps)
    assert {"mfu", "peak_mem_gib", "resume_bit_identical", "async_blocking_over_sync_save"} <= set(summary["targets"])


def test_the_files_that_come_back_hold_every_log(smoke):
    _, steps, out = smoke
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "profile-trace.json.gz", "summary.json",
                                                     "summary.md"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"{name}.log" for name in STEPS} <= names and "tests.xml" in names
    assert {f"{name}.json" for name in STEPS if name != "tests"} <= names
    assert "| throughput | ok |" in (out / "summary.md").read_text()


def test_steps_without_the_time_they_need_are_skipped_not_started(tmp_path, capsys):
    # a budget smaller than every step's reserve: nothing starts, and the summary says why for each step
    assert check.main(["--smoke", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                       "--budget-s", "1"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    every = [s.name for s in check.steps(tmp_path, [], True, tmp_path)]
    assert set(STEPS) | set(LEGS) | set(STEP_LEGS) <= set(every)
    assert [(s["name"], s["status"]) for s in summary["steps"]] == [(name, "skipped") for name in every]
    assert all("left of the budget" in s["reason"] for s in summary["steps"])
    assert not list((tmp_path / "work").glob("*.log"))


NO_RAY = """
import sys

class NoRay:  # the GPU machine: Ray is not installed
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ModuleNotFoundError(f"No module named {name!r}")

sys.meta_path.insert(0, NoRay())
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
"""


def test_the_gpu_tests_collect_without_ray():
    tests, excluded = check.gpu_tests()
    assert {"tests/test_gpu.py", "tests/test_loss.py", "tests/test_attention.py"} <= set(tests)
    assert "tests/test_gpu_check.py" not in tests and not excluded
    proc = subprocess.run([sys.executable, "-c", NO_RAY, *tests], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tests/test_gpu.py::test_deterministic_kernels_repeat_a_step_bit_for_bit" in proc.stdout


def test_the_table_shows_a_recipe_cut_off_at_the_time_limit_without_numbers():
    ok = {"status": "ok", "tokens_per_s": 10.0, "mfu": 0.5, "computed_per_real_token": 1.0, "peak_mem_gib": 2.0,
          "micro_batch_tokens": 4096}
    steps = [{"name": "throughput", "status": "timeout", "seconds": 240,
              "result": {"variants": {"varlen": ok, "compiled": {"status": "running"}}}}]
    text = check.table({"steps": steps, "targets": check.targets({s["name"]: s for s in steps})})
    assert "| varlen | ok | 10 | 50.0% | 1.00 | 2.00 | 4096 |" in text
    assert "| compiled | running | - | - | - | - | None |" in text
    assert "mfu 0.5 (target 0.4): True" in text and "resume_bit_identical None (target True): None" in text


def test_bench_results_record_versions_on_a_machine_without_ray(monkeypatch):
    # bench/throughput.py writes environment() into every result file, on the GPU machine too, which has no Ray
    sys.path.insert(0, str(REPO / "bench"))
    import common

    real = common.version

    def version(name: str) -> str:
        if name == "ray":
            raise common.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(common, "version", version)
    env = common.environment()
    assert env["ray"] is None and env["torch"] and env["transformers"]


@pytest.mark.timeout(2400)  # each leg in its own process
def test_the_issue_39_legs_run_and_record_what_they_measure(legs):
    summary, steps, _ = legs
    assert list(steps) == LEGS
    assert steps["bundle"]["status"] == "skipped" and "no bundle at" in steps["bundle"]["reason"]
    assert all(steps[name]["status"] == "ok" for name in LEGS[1:]), \
        {name: s.get("log_tail") for name, s in steps.items() if s["status"] != "ok"}

    for mode in ("sharded", "full"):  # each rank's peaks during a save, above what training held
        memory = steps["save_memory"]["result"][mode]
        assert memory["host_peak_gib"] > 0 and memory["host_peak_over_training_gib"] >= 0 and memory["seconds"] > 0

    titan = steps["titan"]["result"]
    assert titan["data"]["samples"] > 0 and titan["data"]["tokens_per_step"] == \
        titan["data"]["local_batch_size"] * check.PLANS["smoke"]["seq_len"]
    assert titan["command"][:3] == ["python", "-m", "torchtitan.train"] and len(titan["differences"]) >= 5
    assert titan["dry"].startswith("not run: ")  # no torchtitan here: tests/test_gpu_bundle.py runs it from a bundle



def test_the_issue_47_legs_run_and_record_what_they_measure(step_legs):
    summary, steps, _ = step_legs
    assert list(steps) == STEP_LEGS
    assert all(s["status"] == "ok" for s in steps.values()), {n: s.get("log_tail") for n, s in steps.items()}

    tier = steps["memory_tier"]["result"]  # no tier, every 2 steps (every 10 on a GPU), every step
    assert set(tier["step_s"]) == {"none", "every_2", "every_1"} and all(v > 0 for v in tier["step_s"].values())
    assert tier["over_none"]["every_1"] == tier["step_s"]["every_1"] / tier["step_s"]["none"]
    runs = {name: rs[0] for name, rs in tier["runs"].items()}
    assert "taken" not in runs["none"] and runs["none"]["snapshot_calls"] == 0
    for name in ("every_2", "every_1"):  # snapshots taken and timed, the tier on, its buffer the planned size
        assert runs[name]["taken"] >= 1 and runs[name]["snapshot_calls"] == len(runs[name]["snapshot_call_s"]) >= 1
        assert runs[name]["off"] is None and runs[name]["staging_bytes"] == tier["staging_bytes"]
    assert tier["snapshot_call_median_s"] > 0 and tier["staging_over_plan"] == pytest.approx(1.0, abs=0.05)
    assert not Path(tier["memory_dir"]).exists()  # the snapshots' private directory, removed
    assert summary["targets"]["tier_every_step_over_none"]["value"] == tier["over_none"]["every_1"]

    fp8 = steps["fp8"]["result"]
    bf16, refused = fp8["variants"]["bf16"], fp8["variants"]["fp8"]
    assert bf16["status"] == "ok" and bf16["tokens_per_s"] > 0 and bf16["fp8_layers"] == 0
    assert len(bf16["losses"]) == check.PLANS["smoke"]["fp8_steps"]
    # FP8 refused on this CPU by the trainer's own check: the reason recorded, no FP8 numbers, no comparison
    assert refused["status"] == "refused" and "config key 'parallel.fp8'" in refused["reason"]
    assert "this worker trains on cpu" in refused["reason"] and not {"tokens_per_s", "losses"} & set(refused)
    assert fp8["comparison"] is None
    assert summary["targets"]["fp8_loss_within_tolerance"] == {"value": None, "target": True, "met": None}
    assert not tier["ray_imported"] and not fp8["ray_imported"]


def test_the_fp8_comparison_holds_the_loss_to_its_tolerance():
    import step_legs

    bf16 = {"status": "ok", "tokens_per_s": 100.0, "losses": [3.0, 2.0, 1.0, 1.0]}
    close = {**bf16, "tokens_per_s": 150.0, "losses": [3.1, 2.2, 1.02, 1.04]}
    far = {**close, "losses": [3.0, 2.0, 1.2, 1.0]}
    c = step_legs.compare(bf16, close, window=2)
    assert c["fp8_over_bf16_tokens_per_s"] == 1.5 and c["relative_difference"] == pytest.approx(0.03)
    assert c["loss_within_tolerance"] is True and c["step_relative_difference_max"] == pytest.approx(0.1)
    assert step_legs.compare(bf16, far, window=2)["loss_within_tolerance"] is False  # 10% apart over the window
    assert step_legs.compare(bf16, {"status": "refused", "reason": "a CPU"}, window=2) is None


def test_a_plan_value_is_replaced_by_name_and_an_unknown_one_refused(tmp_path):
    assert check.main(["--smoke", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--budget-s", "1",
                       "--plan", "fp8_steps=300", "--plan", 'fp8_recipe="varlen"']) == 0
    plan = json.loads((tmp_path / "work" / "plan.json").read_text())
    assert (plan["fp8_steps"], plan["fp8_recipe"]) == (300, "varlen")
    with pytest.raises(SystemExit):
        check.main(["--smoke", "--out", str(tmp_path / "out"), "--plan", "fp8_stepz=300"])
