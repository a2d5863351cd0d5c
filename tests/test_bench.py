"""The benchmark harness, run for real at toy size, so that the commands in docs/BENCHMARKS.md keep working. No
timings are asserted (they belong in the benchmark's report); what is checked is what must hold on any machine:
the variants train the same steps alike, sharding divides the optimizer state, and every result file is written.
The harness's Ray legs (throughput's raysft variant, recovery.py) are not launched here: that Ray trains as torchrun
does, and that a killed worker costs only the steps since the snapshot or checkpoint, is the suite's in
tests/test_checkpoint_ray.py and tests/test_faults_cluster.py, on the same code."""

import json
import subprocess
import sys

import pytest
from conftest import REPO, cli_env

pytestmark = pytest.mark.slow  # whole benchmarks: not in make test-fast

TOY = ["--hidden", "128", "--layers", "2", "--seq-len", "128", "--micro-batch", "2", "--data", "builtin:demo"]


@pytest.fixture
def bench(tmp_path):
    def run(script: str, *args: str, toy: bool = True) -> list[dict]:
        out = tmp_path / f"{script}.json"
        with cli_env() as env:  # the harness's scratch directories go to tmp_path
            proc = subprocess.run([sys.executable, str(REPO / "bench" / f"{script}.py"), *(TOY if toy else ()),
                                   *args, "--out",
                                   str(out)], env={**env, "TMPDIR": str(tmp_path)}, cwd=tmp_path,
                                  capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        saved = json.loads(out.read_text())
        assert saved["command"].startswith("python ") and saved["environment"]["torch"]
        assert "|---|" in out.with_suffix(".md").read_text()  # the markdown table beside the JSON
        return saved["results"]

    return run


def test_throughput_runs_the_torchrun_and_hf_variants_side_by_side_and_profiles_one(bench):
    # the other raysft variants are left out: tests/test_trainer_modes.py checks packed and varlen training against
    # padded training, and bench/gpu/check.py's smoke run (tests/test_gpu_check.py) the padded recipe's padding
    # (the LoRA variants are the same launch with model.lora.r set: tests/test_lora.py trains LoRA in every mode)
    results = bench("throughput", "--variants", "torchrun-varlen,hf", "--global-batch",
                    "8", "--steps", "3", "--warmup", "1", "--repeats", "1", "--profile", "torchrun-varlen")
    by = {r["variant"]: r for r in results}
    assert list(by) == ["torchrun-varlen", "hf"]
    assert all(r["median"] > 0 and r["vs_baseline"] > 0 for r in results) and by["torchrun-varlen"]["vs_baseline"] == 1
    # padding: none when packed, most when padded to 128
    assert by["torchrun-varlen"]["computed_per_real_token"] == 1.0 < by["hf"]["computed_per_real_token"]
    profile = by["torchrun-varlen"]["profile"]
    assert 0 < profile["busy_fraction"] <= 1 and profile["top"][0]["self_ms"] > 0 and "profile" not in by["hf"]


def test_checkpoint_measures_every_mode(bench):
    results = bench("checkpoint", "--repeats", "1", "--goodput-steps", "4")
    by = {r["variant"]: r for r in results}
    saves = [by.pop(v) for v in ("full", "full-async", "sharded", "sharded-async")]
    assert sorted(by) == ["goodput-full", "goodput-sharded", "goodput-sharded-async"]
    assert all(g["every_2_over_end"] > 0 for g in by.values())
    # the same state, either way: DCP stores each parameter's optimizer settings beside its tensors, a fixed cost
    # per parameter that is some 5% of a toy model's few MB
    assert saves[2]["bytes"] == pytest.approx(saves[0]["bytes"], rel=0.1)
    assert all(r["save_s"] > 0 and r["load_s"] > 0 and r["disk_write_gbps"] > 0 for r in saves)
    # written once: what the processes wrote is the checkpoint's size, not twice it (a copy into storage)
    assert all(0.95 < run["bytes_written"] / run["bytes"] < 1.5 for r in saves for run in r["runs"]), saves


def test_checkpoint_floor_measures_each_floor_against_dd(bench):
    results = bench("checkpoint_floor", "--state-mb", "16", "--repeats", "1", toy=False)
    assert [r["floor"] for r in results] == ["dd (one writer)", "write", "write + sha256", "write || sha256",
                                             "write + crc32", "gather to rank 0", "gather, rank 0 writes + sha256"]
    assert all(r["seconds"] > 0 and r["vs_dd"] > 0 for r in results)


def test_memory_shows_sharding_divide_the_optimizer_state_and_lora_shrink_it(bench):
    full_shard, lora = bench("memory", "--workers", "2", "--strategies", "FULL_SHARD,FULL_SHARD+lora",
                             "--steps", "2", "--lora-r", "4")
    # AdamW's two fp32 moments: 8 of the 16 bytes per parameter of the model state in theory, which is divided by
    # the 2 workers under FULL_SHARD (NO_SHARD's is the whole: tests/test_strategies.py trains both alike)
    assert full_shard["model_state_theory_mib"] > 0
    assert full_shard["breakdown_mib"]["OptState"] == pytest.approx(full_shard["model_state_theory_mib"] / 2,
                                                                   rel=0.02)
    # rank 4 on every decoder linear layer of a hidden-128 model: a few percent of its parameters get AdamW state
    assert lora["strategy"] == "FULL_SHARD+lora" and lora["breakdown_mib"]["OptState"] < 0.1 * \
        full_shard["breakdown_mib"]["OptState"]


def test_memory_checksum_measures_the_tiers_writer_with_and_without_it(bench, tmp_path):
    results = bench("memory_checksum", "--mb", "8", "--repeats", "1", "--dir", str(tmp_path), toy=False)
    assert [r["variant"] for r in results] == ["write", "write + checksum", "read", "read + check"]
    assert all(r["median_s"] > 0 and r["gb_per_s"] > 0 for r in results)
    assert results[0]["vs_baseline"] == results[2]["vs_baseline"] == 1.0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("raysft-bench-")]  # its part removed
