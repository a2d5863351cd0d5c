import pytest

from raysft.cli import main
from raysft.config import ConfigError, TrainConfig, config_from_dict, load_config


def test_defaults_are_the_demo_and_valid():
    cfg = TrainConfig()
    assert cfg.parallel.sharding == "FULL_SHARD" and cfg.checkpoint.mode == "auto"
    assert cfg.data.paths == ["builtin:demo"] and cfg.model.config == "demo-tiny"


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  max_steps: 7\nrun:\n  name: abc\n")
    cfg = load_config(path, ["train.lr=0.5", "scaling.num_workers=4", "data.paths=[a.json, b.jsonl]",
                             "parallel.cpu_offload=true"])
    assert (cfg.train.max_steps, cfg.train.lr, cfg.run.name) == (7, 0.5, "abc")
    assert cfg.scaling.num_workers == 4 and cfg.data.paths == ["a.json", "b.jsonl"] and cfg.parallel.cpu_offload


def test_the_shipped_demo_config_loads():
    from conftest import REPO

    cfg = load_config(REPO / "jobs" / "configs" / "demo.yaml")
    assert cfg.scaling.num_workers == 2 and cfg.run.name == "demo"


@pytest.mark.parametrize("overrides, key", [
    (["train.max_stepz=3"], "train.max_stepz"),
    (["nosection.x=1"], "nosection"),
    (["train.max_steps=abc"], "train.max_steps"),
    (["train.max_steps=true"], "train.max_steps"),
    (["parallel.sharding=FULLSHARD"], "parallel.sharding"),
    (["train.global_batch_size=10"], "train.global_batch_size"),
    (["train.betas=[0.9]"], "train.betas"),
    (["checkpoint.every_n_steps=0"], "checkpoint.every_n_steps"),
    (["parallel.activation_checkpointing=some"], "parallel.activation_checkpointing"),
    (["run.name=a/b"], "run.name"),
    (["run.name=.."], "run.name"),
    (["run.name=."], "run.name"),
    (["run.name=''"], "run.name"),
    (["train.grad_clip=0"], "train.grad_clip"),
    (["train.grad_clip=-1"], "train.grad_clip"),
    (["train.lr=.inf"], "train.lr"),
    (["train.lr=nan"], "train.lr"),
    (["train.lr=0"], "train.lr"),
    (["train.weight_decay=-1"], "train.weight_decay"),
    (["train.weight_decay=.nan"], "train.weight_decay"),
    (["train.betas=[0.9, .inf]"], "train.betas"),
    (["scaling.cpus_per_worker=.inf"], "scaling.cpus_per_worker"),
    (["model.attn_implementation=flash_attn"], "model.attn_implementation"),
    (["model.attn_implementation=kernels-community/flash-attn"], "model.attn_implementation"),
    (["data.paths=notalist"], "data.paths"),
    (["data.paths=[a.jsonl, {path: b.jsonl, weight: 0}]"], r"data.paths\[1\]': weight must be a finite"),
    (["data.paths=[{path: builtin:demo, wieght: 2}]"], r"data.paths\[0\]': unknown key 'wieght'"),
    (["data.eval_paths=[{weight: 2}]"], r"data.eval_paths\[0\]': needs a 'path'"),
    (["scaling.min_workers=3"], "scaling.min_workers"),  # more than num_workers=2
    (["scaling.max_failures=-2"], "scaling.max_failures"),
])
def test_bad_values_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


def test_a_float_written_as_yaml_reads_it_is_accepted_in_either_form(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 3e-4\n  weight_decay: 1E-2\n")  # YAML 1.1 reads both as strings
    cfg = load_config(path, ["train.grad_clip=5e-1"])
    assert (cfg.train.lr, cfg.train.weight_decay, cfg.train.grad_clip) == (3e-4, 1e-2, 0.5)
    with pytest.raises(ConfigError, match=r"'train\.lr': expected float, got 'fast'"):
        load_config(None, ["train.lr=fast"])


def test_every_attention_kernel_transformers_knows_is_accepted_and_one_registered_later_too():
    from transformers import AttentionInterface

    for name in ("sdpa", "eager", "flex_attention", "flash_attention_2"):
        assert load_config(None, [f"model.attn_implementation={name}"]).model.attn_implementation == name
    with pytest.raises(ConfigError, match="raysft_test_kernel"):
        load_config(None, ["model.attn_implementation=raysft_test_kernel"])
    AttentionInterface.register("raysft_test_kernel", lambda *args, **kwargs: None)
    assert load_config(None, ["model.attn_implementation=raysft_test_kernel"])


def test_a_set_value_that_is_not_yaml_is_a_config_error_naming_the_item(capsys):
    with pytest.raises(ConfigError, match=r"--set 'data\.paths=\[a\.json': the value is not valid YAML"):
        load_config(None, ["data.paths=[a.json"])
    assert main(["train", "--set", "train.lr: {"]) == 2  # no '=': the expected form is named
    assert main(["train", "--set", "data.paths=[a.json"]) == 2
    assert "data.paths=[a.json" in capsys.readouterr().err


def test_round_trip_through_dict():
    cfg = load_config(None, ["train.max_steps=11", "parallel.sharding=NO_SHARD"])
    assert config_from_dict(cfg.to_dict()) == cfg


def test_cli_config_error_exits_2(capsys):
    assert main(["train", "--set", "train.max_steps=-1"]) == 2
    assert "train.max_steps" in capsys.readouterr().err


def test_elastic_range_needs_a_global_batch_that_every_worker_count_divides():
    ok = load_config(None, ["scaling.num_workers=4", "scaling.min_workers=2", "train.micro_batch_size=1",
                            "train.global_batch_size=12"])
    assert (ok.scaling.min_workers, ok.scaling.num_workers) == (2, 4)
    with pytest.raises(ConfigError, match=r"global_batch_size.*× 3 = 6 \(scaling.min_workers=2"):
        load_config(None, ["scaling.num_workers=4", "scaling.min_workers=2", "train.micro_batch_size=2",
                           "train.global_batch_size=16"])  # 4 and 2 workers divide 16, 3 does not


def test_the_configuration_doc_holds_the_current_configuration_reference():
    from conftest import REPO

    from raysft.config import reference_markdown

    doc = (REPO / "docs" / "CONFIGURATION.md").read_text()
    start = doc.index("<!-- config-reference:")
    table = doc[doc.index("\n", start) + 1: doc.index("<!-- config-reference:end -->")].strip()
    assert table == reference_markdown(), "regenerate the table in docs/CONFIGURATION.md: python -c 'from " \
                                          "raysft.config import reference_markdown as r; print(r())'"
