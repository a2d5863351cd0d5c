"""What a path in the config means (raysft.launch.paths), without Ray: every path key resolved once against the
directory the command runs in, names that are no paths kept, what must exist checked by its key on the driver, and
on a worker a missing directory is a run-ending error naming the node. The docs' DPO commands run from a fresh
clone's layout under torchrun and Ray in tests/test_dpo_path.py."""

import dataclasses
import json
import typing

import pytest
from conftest import tiny_config

from raysft.config import ConfigError, TrainConfig, config_from_dict, load_config
from raysft.errors import ends_the_run
from raysft.launch.paths import PATH_KEYS, check_paths, check_worker_paths, resolve_paths
from raysft.launch.prelaunch import RUN_FILE, claim_run_dir

# Every other key that holds text, and why it is no path of this machine's filesystem. A new text key must be
# put in PATH_KEYS (resolved on the driver) or here: test_every_text_key_is_a_path_key_or_declared_no_path.
NOT_PATHS = {
    "model.attn_implementation": "a kernel's name",
    "model.lora.target_modules": "layer names",
    "data.system_prompt": "text",
    "train.weight_decay_exclude": "regular expressions",
    "parallel.activation_checkpointing": "'none', 'full' or k",
    "run.name": "a plain directory name under run.storage_path",
    "metrics.trackers": "tracker names",
    "metrics.project": "a tracker's project name",
    "metrics.mlflow_tracking_uri": "MLflow's URI grammar: 'databricks' and the like are names, not paths",
    "checkpoint.best_metric": "a metric's name",
    "eval.scorers": "scorer names",
    "eval.stop": "text that ends a generation",
    "eval.answer_pattern": "a regular expression",
}


def text_keys(cls=TrainConfig, prefix="") -> list[str]:
    """Every key whose value is text or a list holding text, by walking the config's dataclasses."""
    keys, hints = [], typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            keys += text_keys(tp, f"{prefix}{f.name}.")
        elif tp is str or (typing.get_origin(tp) is list and "str" in str(tp)):
            keys.append(prefix + f.name)
    return keys


def test_every_text_key_is_a_path_key_or_declared_no_path():
    keys = text_keys()
    assert set(PATH_KEYS) <= set(keys), set(PATH_KEYS) - set(keys)
    assert sorted(set(keys) - set(PATH_KEYS)) == sorted(NOT_PATHS)


def test_every_relative_path_is_taken_from_the_base_directory_once_and_names_are_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    base = tmp_path / "typed-here"
    config = load_config(None, [
        "model.path=runs/demo-model", "model.tokenizer=../tok", "model.config=cfg/config.json",
        "data.paths=[a.jsonl, {path: ./sub/b.jsonl, weight: 2}, builtin:demo]", "data.eval_paths=[~/v.jsonl]",
        "data.chat_template=t.jinja", "data.store_dir=stores", "run.storage_path=runs",
        "checkpoint.memory_dir=shm/raysft"])
    resolved = resolve_paths(config, base)
    m, d = resolved.model, resolved.data
    assert (m.path, m.tokenizer, m.config) == (f"{base}/runs/demo-model", f"{tmp_path}/tok", f"{base}/cfg/config.json")
    assert d.paths == [f"{base}/a.jsonl", {"path": f"{base}/sub/b.jsonl", "weight": 2}, "builtin:demo"]
    assert d.eval_paths == [f"{tmp_path}/home/v.jsonl"]
    assert (d.chat_template, d.store_dir) == (f"{base}/t.jinja", f"{base}/stores")
    assert (resolved.run.storage_path, resolved.checkpoint.memory_dir) == (f"{base}/runs", f"{base}/shm/raysft")
    assert config.model.path == "runs/demo-model" and config.data.paths[1]["path"] == "./sub/b.jsonl"  # a copy
    assert resolve_paths(resolved, tmp_path / "elsewhere") == resolved  # once: absolute paths stay as they are
    assert config_from_dict(resolved.to_dict()) == resolved  # what a worker rebuilds from the shipped dict

    names = load_config(None, ["model.config=llama-1b", "data.chat_template=vicuna", "checkpoint.memory_dir=",
                               "run.storage_path=s3://bucket/runs", "data.store_dir=/mnt/shared/stores"])
    kept = resolve_paths(names, base)
    assert (kept.model.config, kept.model.tokenizer, kept.data.chat_template) == ("llama-1b", "builtin:demo", "vicuna")
    assert (kept.run.storage_path, kept.checkpoint.memory_dir, kept.data.paths) == \
        ("s3://bucket/runs", "", ["builtin:demo"])
    assert resolve_paths(load_config(None, ["run.storage_path=file://runs"]), base).run.storage_path == \
        f"file://{base}/runs"
    # model.config: a bare word is a preset's name, mistyped (refused by that name), unless base holds it
    (base / "my-config").mkdir(parents=True)
    assert resolve_paths(load_config(None, ["model.config=demo-tiyn"]), base).model.config == "demo-tiyn"
    assert resolve_paths(load_config(None, ["model.config=my-config"]), base).model.config == f"{base}/my-config"
    monkeypatch.chdir(tmp_path)  # the default base: where the command runs
    assert resolve_paths(config).model.path == f"{tmp_path}/runs/demo-model"


def test_a_missing_path_is_a_config_error_naming_the_key_and_the_absolute_path_on_the_driver(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.jsonl").write_text("")
    (tmp_path / "model").write_text("a file, not a directory")
    cases = {
        "model.path=runs/demo-model": f"config key 'model.path': {tmp_path}/runs/demo-model does not exist (a "
                                      f"relative path is taken from {tmp_path}, where the command runs)",
        "model.path=model": f"config key 'model.path': {tmp_path}/model is not a directory",
        "model.tokenizer=/nowhere/tok": "config key 'model.tokenizer': /nowhere/tok does not exist",
        "model.config=cfg.json": f"config key 'model.config': {tmp_path}/cfg.json does not exist",
        "data.paths=[a.jsonl, b.jsonl]": f"config key 'data.paths[1]': {tmp_path}/b.jsonl does not exist",
        "data.eval_paths=[v.jsonl]": f"config key 'data.eval_paths[0]': {tmp_path}/v.jsonl does not exist",
        "data.chat_template=t.jinja": f"config key 'data.chat_template': {tmp_path}/t.jinja does not exist",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError) as e:
            check_paths(resolve_paths(load_config(None, [override])))
        assert str(e.value).startswith(message), (override, str(e.value))
    check_paths(resolve_paths(load_config(None, ["data.paths=[a.jsonl, builtin:demo]"])))  # present, or builtin
    check_paths(resolve_paths(load_config(None, ["model.config=llama-1b", "run.storage_path=not-there-yet"])))


def test_a_path_a_worker_does_not_see_ends_the_run_naming_the_node(tmp_path):
    store, where = tmp_path / "store", "node 10.0.0.2 (rank 3)"
    store.mkdir()
    # the data files are read by the driver alone (it tokenizes them): a worker does not look for them
    check_worker_paths(resolve_paths(load_config(None, ["data.paths=[on-the-driver.jsonl]"]), tmp_path), [store], where)
    missing = {
        "data.store_dir": (TrainConfig(), [store, tmp_path / "eval-store"], tmp_path / "eval-store"),
        "model.path": (resolve_paths(load_config(None, ["model.path=runs/m"]), tmp_path), [store], tmp_path / "runs/m"),
    }
    for key, (config, stores, path) in missing.items():
        with pytest.raises(ConfigError) as e:
            check_worker_paths(config, stores, where)
        assert str(e.value).startswith(f"config key '{key}': {path} is not a directory on {where}, where a Ray "
                                       "worker reads it, though the driver found it"), str(e.value)
        assert ends_the_run(e.value)  # recorded and raised once on the driver, never retried by Ray


def test_a_run_recorded_with_a_relative_path_is_the_same_run_from_the_same_directory(tmp_path, monkeypatch):
    """An older raysft recorded model.config as written; a launch now records and compares absolute paths."""
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    for d in (here, elsewhere):
        (d / "cfg").mkdir(parents=True)
        (d / "cfg" / "config.json").write_text("{}")
    monkeypatch.chdir(here)
    config = tiny_config(tmp_path, **{"model.config": "cfg/config.json"})
    claim_run_dir(resolve_paths(config), "data-a")
    record = config.run_dir / RUN_FILE
    assert json.loads(record.read_text())["model.config"] == f"{here}/cfg/config.json"
    monkeypatch.chdir(elsewhere)  # the same words name another file there
    with pytest.raises(ConfigError, match=f"started with model.config='{here}/cfg/config.json', this launch has "
                                          f"'{elsewhere}/cfg/config.json'"):
        claim_run_dir(resolve_paths(config), "data-a")
    monkeypatch.chdir(here)
    record.write_text(json.dumps({**json.loads(record.read_text()), "model.config": "cfg/config.json"}))  # older
    assert claim_run_dir(resolve_paths(config), "data-a") is None
    assert claim_run_dir(config, "data-a") is None  # a config not yet resolved means the same here
