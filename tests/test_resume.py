"""Which run a launch continues: the run-defining settings recorded on first launch, --fresh, nothing overwritten."""

import pytest
from conftest import tiny_config

from raysft.config import ConfigError
from raysft.resume import RUN_FILE, checkpoint_name, claim_run_dir


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


@pytest.mark.parametrize("fresh", [False, True])
def test_a_directory_raysft_did_not_create_is_neither_written_into_nor_moved(tmp_path, fresh):
    cfg = tiny_config(tmp_path, **{"run.name": "home"})
    (cfg.run_dir / "Documents").mkdir(parents=True)
    (cfg.run_dir / "Documents" / "thesis.tex").write_text("years of work")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match=f"{cfg.run_dir} exists and is not a raysft run directory"):
        claim_run_dir(cfg, "data-a", fresh=fresh)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
