"""Which run a launch continues: the run-defining settings recorded on first launch, --fresh, nothing overwritten."""

import pytest
from conftest import tiny_config

from raysft.checkpoint import checkpoint_name
from raysft.config import ConfigError
from raysft.launch.prelaunch import RUN_FILE, claim_run_dir


def test_a_run_records_what_defines_it_and_accepts_other_changes(tmp_path):
    cfg = tiny_config(tmp_path)
    assert claim_run_dir(cfg, "data-a") is None
    assert (cfg.run_dir / RUN_FILE).is_file()
    # workers, sharding, schedule length and learning rate may change between launches of one run
    again = tiny_config(tmp_path, **{"scaling.num_workers": 1, "parallel.sharding": "NO_SHARD",
                                     "train.max_steps": 99, "train.lr": 1e-4})
    assert claim_run_dir(again, "data-a") is None


@pytest.mark.parametrize("change, fingerprint, message", [
    ({"train.seed": 7}, "data-a", r"started with train.seed=0, this launch has 7"),
    ({"model.config": "llama-1b"}, "data-a", r"started with model.config=.demo-tiny."),
    ({}, "data-b", r"the training data .* differs"),
])
def test_relaunching_a_run_with_other_data_model_or_seed_is_refused_and_writes_nothing(tmp_path, change,
                                                                                       fingerprint, message):
    claim_run_dir(tiny_config(tmp_path), "data-a")
    (tiny_config(tmp_path).run_dir / "checkpoint_00000003").mkdir()
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match=message + r".*--fresh"):
        claim_run_dir(tiny_config(tmp_path, **change), fingerprint)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_fresh_keeps_the_old_run_beside_the_new_one(tmp_path):
    cfg = tiny_config(tmp_path)
    claim_run_dir(cfg, "data-a")
    (cfg.run_dir / "checkpoint_00000003").mkdir()
    moved = claim_run_dir(tiny_config(tmp_path, **{"train.seed": 7}), "data-b", fresh=True)
    assert moved.name.startswith(f"{cfg.run.name}.replaced-") and (moved / "checkpoint_00000003").is_dir()
    assert sorted(p.name for p in cfg.run_dir.iterdir()) == [RUN_FILE]


def test_a_step_saved_again_gets_its_own_directory():
    assert checkpoint_name(6) == "checkpoint_00000006"
    assert checkpoint_name(6, frozenset({"checkpoint_00000006", "checkpoint_00000006.1"})) == "checkpoint_00000006.2"


@pytest.mark.parametrize("sets, message", [
    ({"model.path": "/nonexistent/llama"}, r"'model.path': /nonexistent/llama does not exist"),
    ({"model.config": "no-such-preset"}, r"'model.config': 'no-such-preset' is neither a preset"),
    ({"model.config": "SMALL_VOCAB"}, r"'model.tokenizer': the tokenizer has \d+ tokens but the model's vocab_size"),
    ({"train.global_batch_size": 4096, "train.micro_batch_size": 2048},
     r"'train.global_batch_size': 4096 samples per step, but the data has 1200"),
])
def test_errors_every_worker_would_meet_are_config_errors_before_any_worker_starts(tmp_path, sets, message):
    """Raised on the driver (rank 0 without Ray) with the key named, never retried in workers."""
    from transformers import LlamaConfig

    from raysft.launch.prelaunch import prepare_launch

    if sets.get("model.config") == "SMALL_VOCAB":
        LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                    num_attention_heads=1).save_pretrained(tmp_path / "small")
        sets = {"model.config": str(tmp_path / "small")}
    cfg = tiny_config(tmp_path, **sets)
    with pytest.raises(ConfigError, match=message):
        prepare_launch(cfg)
    assert not cfg.run_dir.exists()  # nothing claimed


@pytest.mark.parametrize("fresh", [False, True])
def test_a_directory_raysft_did_not_create_is_neither_written_into_nor_moved(tmp_path, fresh):
    cfg = tiny_config(tmp_path, **{"run.name": "home"})
    (cfg.run_dir / "Documents").mkdir(parents=True)
    (cfg.run_dir / "Documents" / "thesis.tex").write_text("years of work")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match=f"{cfg.run_dir} exists and is not a raysft run directory"):
        claim_run_dir(cfg, "data-a", fresh=fresh)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_relaunch_with_another_max_seq_len_is_refused_before_its_store_is_tokenized(tmp_path):
    """docs/RUNS.md: a run launched again with other data is refused before anything is written. A new
    data.max_seq_len makes a new store: the refusal comes before it is tokenized into data.store_dir."""
    from raysft.launch.prelaunch import prepare_launch

    prepare_launch(tiny_config(tmp_path))  # the first launch: its store, and the run claimed
    store_dir = tiny_config(tmp_path).store_dir
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match=r"the training data .* differs.*--fresh"):
        prepare_launch(tiny_config(tmp_path, **{"data.max_seq_len": 128}))
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before, sorted(store_dir.iterdir())
