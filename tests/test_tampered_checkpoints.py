"""Checkpoints that are not what they claim: a manifest that is JSON but no manifest, a DCP index or saved value
whose pickle would run code, and exports that would replace a run. Ray-free: a real Trainer in this process on a
gloo group of one writes real full and sharded checkpoints; `report` copies them into the run directory as
Ray's upload does."""

import io
import json
import os
import pickle
import re
import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_config
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.filesystem import _StorageInfo

import raysft.checkpoint.manifest as manifest_module
from raysft.checkpoint import (
    MANIFEST_FILE,
    CheckpointError,
    DirectorySink,
    find_resume_dir,
    incomplete_reason,
    read_trainer_state,
)
from raysft.checkpoint.dcp_read import dcp_reader
from raysft.cli import main
from raysft.data import prepare_store
from raysft.data.tokenizer import load_tokenizer
from raysft.hf import shards as hf_shards
from raysft.hf.shards import MODEL_INDEX
from raysft.launch.prelaunch import claim_run_dir
from raysft.products.chat_model import ChatModel
from raysft.products.export import EXPORT_FILE, export
from raysft.training.trainer import Trainer, WorkerContext


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gloo():
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MASTER_ADDR", "127.0.0.1")
        env.setenv("MASTER_PORT", str(_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        yield
        dist.destroy_process_group()


def trainer(cfg, resume_dir=None) -> Trainer:
    store = prepare_store(cfg.data, load_tokenizer(cfg.model, cfg.data.chat_template), cfg.store_dir).path
    claim_run_dir(cfg, store.name)
    taken = frozenset(p.name for p in cfg.run_dir.glob("checkpoint_*"))
    return Trainer(cfg, store, resume_dir, DirectorySink(cfg.run_dir, 0, taken=taken),
                   WorkerContext(rank=0, world_size=1, device=torch.device("cpu")))


@pytest.fixture(scope="module")
def runs(gloo, tmp_path_factory):
    """A sharded run with checkpoints at steps 1 and 2, and a full one at step 1."""
    tmp = tmp_path_factory.mktemp("runs")
    made = {}
    for mode in ("sharded", "full"):
        cfg = tiny_config(tmp, **{"checkpoint.mode": mode, "run.name": mode, "train.max_steps": 2 if mode ==
                                  "sharded" else 1, "checkpoint.every_n_steps": 1, "scaling.num_workers": 1,
                                  "train.global_batch_size": 4, "checkpoint.keep": 9})
        trainer(cfg).train()
        made[mode] = cfg
    return made


def copy(ckpt: Path, dest: Path) -> Path:
    shutil.copytree(ckpt, dest)
    return dest


def resign(ckpt: Path) -> None:
    """Write a manifest that matches the files as they are now: the manifest proves completeness, not origin."""
    (ckpt / MANIFEST_FILE).unlink()
    manifest_module.write_manifest(ckpt, 1, [manifest_module.durable_file_list(ckpt)])


class RunsCode:
    """Unpickling calls os.system: the marker file appears if the pickle's code runs."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("manifest", ["{}", "[]", '{"files": []}', '{"files": {"model.safetensors": {"size": "1"}}}',
                                      '{"files": {"../../x": {"size": 1, "sha256": "0"}}}'])
def test_a_manifest_that_is_json_but_no_manifest_is_an_incomplete_checkpoint(runs, tmp_path, manifest):
    ckpt = copy(runs["full"].run_dir / "checkpoint_00000001", tmp_path / "c")
    (ckpt / MANIFEST_FILE).write_text(manifest)
    assert incomplete_reason(ckpt).startswith(f"{MANIFEST_FILE} is not a raysft manifest")
    with pytest.raises(CheckpointError, match=f"{ckpt}: incomplete checkpoint: {MANIFEST_FILE} is not a raysft"):
        export(ckpt, tmp_path / "out")
    with pytest.raises(CheckpointError, match=f"{ckpt}: incomplete checkpoint: {MANIFEST_FILE} is not a raysft"):
        ChatModel.load(ckpt)


@pytest.mark.parametrize("state", ["[]", '{"format_version": 1}', '{"format_version": 1, "mode": "weird", '
                                   '"step": 1, "cursor": {}, "scheduler": {}, "world_size": 1}'])
def test_a_trainer_state_that_is_json_but_no_state_is_a_checkpoint_error_naming_the_file(runs, tmp_path, state):
    ckpt = copy(runs["full"].run_dir / "checkpoint_00000001", tmp_path / "c")
    (ckpt / "trainer_state.json").write_text(state)
    with pytest.raises(CheckpointError, match=f"{ckpt / 'trainer_state.json'}: (not a raysft|checkpoint format)"):
        read_trainer_state(ckpt)
    assert main(["export", str(ckpt), str(tmp_path / "out")]) == 1


def test_resume_falls_back_past_a_latest_checkpoint_whose_manifest_is_not_one(runs, tmp_path):
    run = copy(runs["sharded"].run_dir, tmp_path / "sharded")
    (run / "checkpoint_00000002" / MANIFEST_FILE).write_text("{}")
    resume_dir, skipped = find_resume_dir(run)
    assert resume_dir == run / "checkpoint_00000001"
    assert skipped == [(str(run / "checkpoint_00000002"), f"{MANIFEST_FILE} is not a raysft manifest: no 'files' "
                                                          "listing")]


def test_a_sharded_index_whose_pickle_runs_code_is_refused_on_resume_export_and_chat(runs, tmp_path):
    marker = tmp_path / "ran"
    ckpt = copy(runs["sharded"].run_dir / "checkpoint_00000002", tmp_path / "evil")
    (ckpt / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    resign(ckpt)
    assert incomplete_reason(ckpt) is None  # complete: the manifest is no defence here
    refused = r"refusing to unpickle posix\.system.*Nothing from it was run"
    with pytest.raises(CheckpointError, match=f"{ckpt}: cannot read the sharded checkpoint's index: .*{refused}"):
        export(ckpt, tmp_path / "out")
    with pytest.raises(CheckpointError, match=refused):
        ChatModel.load(ckpt)
    with pytest.raises(CheckpointError, match=f"{ckpt}: cannot read the sharded checkpoint's index: .*{refused}"):
        trainer(runs["sharded"], resume_dir=ckpt)
    assert not marker.exists()


def test_a_saved_value_whose_pickle_runs_code_is_never_unpickled(runs, tmp_path):
    """DCP stores the optimizer's param groups as torch.save bytes and its default planner loads them with
    weights_only=False: the shard file is a second way in. A resume does not read them (this launch's groups
    apply), and reading them through raysft's planner refuses what is not plain data."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from raysft.checkpoint.dcp_read import SafeLoadPlanner

    marker = tmp_path / "ran"
    ckpt = copy(runs["sharded"].run_dir / "checkpoint_00000002", tmp_path / "evil")
    metadata = dcp_reader(ckpt).read_metadata()
    info = next(s for i, s in metadata.storage_data.items() if i.fqn.endswith(".lr"))
    buf = io.BytesIO()
    torch.save(RunsCode(marker), buf)  # a torch.save archive whose pickle calls os.system
    evil = buf.getvalue()
    shard = ckpt / info.relative_path
    data = shard.read_bytes()
    info.offset, info.length = len(data), len(evil)
    shard.write_bytes(data + evil)
    with (ckpt / ".metadata").open("wb") as f:
        pickle.dump(metadata, f)
    resign(ckpt)
    resumed = trainer(runs["sharded"], resume_dir=ckpt)
    assert resumed.state.step == 2 and not marker.exists()
    groups = get_optimizer_state_dict(resumed.model, resumed.optimizer)["param_groups"]
    with pytest.raises(CheckpointException, match=r"(?s)\.lr: refusing a saved value that is not plain data"):
        dcp.load({"optimizer": {"param_groups": groups}}, storage_reader=dcp_reader(ckpt), planner=SafeLoadPlanner())
    assert not marker.exists()


class PersistentIds(pickle.Pickler):
    """Pickles each storage entry as a persistent id: unpickling it would hand the id to whatever the reader's
    persistent_load does."""

    def persistent_id(self, obj):
        return f"storage {obj.relative_path}" if isinstance(obj, _StorageInfo) else None


def out_of_the_checkpoint(ckpt: Path) -> bytes:
    """The real index with every shard entry pointing at `../x`, where a real copy of the shard lies: a reader that
    followed the name would load it without a complaint."""
    metadata = dcp_reader(ckpt).read_metadata()
    shards = {info.relative_path for info in metadata.storage_data.values()}
    (shard,) = shards
    shutil.copy(ckpt / shard, ckpt.parent / "x")
    for info in metadata.storage_data.values():
        info.relative_path = "../x"
    return pickle.dumps(metadata)


def persistent_ids(ckpt: Path) -> bytes:
    buf = io.BytesIO()
    PersistentIds(buf).dump(dcp_reader(ckpt).read_metadata())
    return buf.getvalue()


TAMPERED_INDEXES = {
    "names_a_file_outside": (out_of_the_checkpoint, r"names a file outside the checkpoint: '\.\./x'"),
    "cut_off": (lambda ckpt: (ckpt / ".metadata").read_bytes()[:200], "not a DCP index: (EOFError|UnpicklingError)"),
    "garbled": (lambda ckpt: b"not a pickle at all", "not a DCP index: UnpicklingError"),
    "persistent_id": (persistent_ids, "refusing a persistent id in a DCP index"),
}


@pytest.mark.parametrize("kind", TAMPERED_INDEXES)
def test_a_sharded_index_that_is_no_index_is_refused_naming_the_checkpoint(runs, tmp_path, kind):
    """Beside code to run, an index can name a file outside the checkpoint, be cut off or garbled, or hold a
    persistent id: resume and export each refuse it with a CheckpointError naming the checkpoint and its index."""
    make, why = TAMPERED_INDEXES[kind]
    ckpt = copy(runs["sharded"].run_dir / "checkpoint_00000002", tmp_path / "run" / "checkpoint_00000002")
    (ckpt / ".metadata").write_bytes(make(ckpt))
    resign(ckpt)
    refused = f"{re.escape(str(ckpt))}: cannot read the sharded checkpoint's index: " \
              f"{re.escape(str(ckpt / '.metadata'))}: {why}"
    with pytest.raises(CheckpointError, match=refused):
        export(ckpt, tmp_path / "out")
    with pytest.raises(CheckpointError, match=refused):
        trainer(runs["sharded"], resume_dir=ckpt)
    assert not (tmp_path / "out").exists()


def test_a_real_sharded_checkpoint_still_resumes_and_exports(runs, tmp_path):
    ckpt = runs["sharded"].run_dir / "checkpoint_00000002"
    assert trainer(runs["sharded"], resume_dir=ckpt).state.step == 2
    out = export(ckpt, tmp_path / "hf")
    assert (out / "model.safetensors").is_file() and json.loads((out / EXPORT_FILE).read_text())["mode"] == "sharded"


def test_export_never_replaces_the_run_its_checkpoints_or_the_checkpoint_it_exports(runs, tmp_path):
    run = copy(runs["full"].run_dir, tmp_path / "run")
    ckpt = run / "checkpoint_00000001"
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for target, why in [(run, "holds the checkpoint being exported"), (ckpt, "holds the checkpoint being exported"),
                        (tmp_path, "holds the checkpoint being exported")]:
        with pytest.raises(FileExistsError, match=why):
            export(ckpt, target, overwrite=True)
    other = copy(run, tmp_path / "other-run")
    with pytest.raises(FileExistsError, match=f"{other} holds a raysft run .*even with --force"):
        export(ckpt, other, overwrite=True)
    assert main(["export", str(ckpt), str(run), "--force"]) == 1
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if "other-run" not in p.parts) == before

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="is not empty and is no raysft export"):
        export(ckpt, mine, overwrite="export")  # what `raysft train --export` asks for
    assert (mine / "notes.txt").read_text() == "keep me"
    export(ckpt, tmp_path / "hf")
    export(ckpt, tmp_path / "hf", overwrite="export")  # an earlier export is replaced
    export(ckpt, mine, overwrite=True)  # --force: the user named it
    assert not (mine / "notes.txt").exists()


def test_a_max_shard_size_below_one_megabyte_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["export", "ckpt", "out", "--max-shard-mb", "0"])
    assert e.value.code == 2 and "--max-shard-mb must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", "ckpt", "out", "--max-shard-mb", "-5"])


def test_chat_refuses_a_full_checkpoint_stripped_of_its_manifest_and_state(runs, tmp_path):
    ckpt = copy(runs["full"].run_dir / "checkpoint_00000001", tmp_path / "stripped")
    (ckpt / MANIFEST_FILE).unlink()
    (ckpt / "trainer_state.json").unlink()  # what is left looks like an HF model directory, unverified
    with pytest.raises(CheckpointError, match=f"{ckpt}: incomplete checkpoint: it holds training state .*cannot "
                                              "be checked"):
        ChatModel.load(ckpt)
    assert ChatModel.load(export(runs["full"].run_dir / "checkpoint_00000001", tmp_path / "hf")).tokenizer


def rewrite_model_files(ckpt: Path, edit) -> list[str]:
    """The full checkpoint's model tensors, changed by `edit`, written back in two files with an index as HF
    writes a large model; the manifest re-signed (it proves completeness, not contents). Returns the files."""
    tensors = edit(load_file(ckpt / "model.safetensors"))
    (ckpt / "model.safetensors").unlink()
    names = list(tensors)
    groups = [names[:len(names) // 2], names[len(names) // 2:]]
    files = hf_shards.file_names("model", 2)
    for group, name in zip(groups, files, strict=True):
        save_file({n: tensors[n] for n in group}, ckpt / name, metadata={"format": "pt"})
    hf_shards.write_index(ckpt, "model", groups, files, sum(t.nbytes for t in tensors.values()))
    resign(ckpt)
    return files


def without_the_norm(tensors):
    return {k: v for k, v in tensors.items() if k != "model.norm.weight"}


def norm_of_129(tensors):
    return {**tensors, "model.norm.weight": torch.ones(129)}


def norm_of_int8(tensors):
    return {**tensors, "model.norm.weight": torch.ones(128, dtype=torch.int8)}


WRONG_FULL = {  # the edit, and what the refusal says after the file it names
    without_the_norm: (lambda ckpt, files: ckpt / MODEL_INDEX,
                       "tensor 'model.norm.weight' of the model is in none of the files"),
    norm_of_129: (lambda ckpt, files: ckpt / files[1],
                  r"tensor 'model.norm.weight' has shape \[129\], the model's is \[128\]"),
    norm_of_int8: (lambda ckpt, files: ckpt / files[1],
                   "tensor 'model.norm.weight' is I8, which raysft does not convert into the model's F32 parameters"),
}


@pytest.mark.parametrize("edit", WRONG_FULL, ids=lambda f: f.__name__)
def test_a_full_checkpoint_whose_files_lack_a_tensor_or_hold_another_shape_or_dtype_is_refused_everywhere(
        runs, tmp_path, edit, capsys):
    """Exported with exit 0 and chatted with (transformers filling the missing norm with random values): export,
    chat and resume each refuse it, naming the file and the tensor, from the headers alone."""
    ckpt = copy(runs["full"].run_dir / "checkpoint_00000001", tmp_path / "run" / "checkpoint_00000001")
    files = rewrite_model_files(ckpt, edit)
    assert incomplete_reason(ckpt) is None
    file, why = WRONG_FULL[edit]
    refused = f"{re.escape(str(file(ckpt, files)))}: {why}"
    assert main(["export", str(ckpt), str(tmp_path / "out")]) == 1
    assert re.search(f"CheckpointError: {refused}", capsys.readouterr().err)
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match=refused):
        ChatModel.load(ckpt)
    with pytest.raises(CheckpointError, match=refused):
        trainer(runs["full"], resume_dir=ckpt)


def test_a_sharded_checkpoint_whose_index_lacks_a_tensor_is_refused_by_export_chat_and_resume(runs, tmp_path):
    ckpt = copy(runs["sharded"].run_dir / "checkpoint_00000002", tmp_path / "run" / "checkpoint_00000002")
    metadata = dcp_reader(ckpt).read_metadata()
    del metadata.state_dict_metadata["model.model.norm.weight"]
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    resign(ckpt)
    refused = f"{re.escape(str(ckpt / '.metadata'))}: tensor 'model.norm.weight' of the model is in none of the files"
    with pytest.raises(CheckpointError, match=refused):
        export(ckpt, tmp_path / "out")
    with pytest.raises(CheckpointError, match=refused):
        ChatModel.load(ckpt)
    with pytest.raises(CheckpointError, match=refused):
        trainer(runs["sharded"], resume_dir=ckpt)
    assert not (tmp_path / "out").exists()
