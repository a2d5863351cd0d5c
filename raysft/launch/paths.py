"""What a path in the configuration means: the same thing as in the directory the command was typed in.

A config names files and directories: the model, the tokenizer, the data, a chat template, where the runs, the
store and the memory tier's snapshots go. A relative one (`model.path: runs/demo-model`) means what it means to
the user, in the directory where `raysft train`, `raysft plan`, `python -m raysft.run` or a `ray job submit`
entrypoint runs (there: the job's working directory), and `~` is that user's home. The processes that read those
paths need not run there: Ray's workers run in a directory of Ray's (under `ray job submit` too, not in the job's
working directory), Ray Data tasks elsewhere again. So the driver resolves every path once, before
the config is shipped to anyone (resolve_paths), and checks that what must exist does, naming the key, before Ray
starts (check_paths); no worker ever interprets a relative path. A Ray worker checks that it sees what the driver
saw (check_worker_paths): a directory missing on one node is no error a restart fixes, so it ends the run as one
line (a ConfigError is run-ending: raysft.errors)."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from raysft.config import BUILTIN, ConfigError, TrainConfig, data_sources
from raysft.storage import is_remote

# Every key whose value may name a file or directory. What a value of them names instead is left as it is: a
# builtin asset, a preset, a chat template's name, a remote URI, "" (a default). RUN_DEFINING_PATHS: those a run
# records in raysft_run.json (raysft.launch.prelaunch).
PATH_KEYS = ("model.path", "model.tokenizer", "model.config", "data.paths", "data.eval_paths", "data.chat_template",
             "data.store_dir", "run.storage_path", "checkpoint.memory_dir", "eval.path")
RUN_DEFINING_PATHS = ("model.path", "model.config", "model.tokenizer")
FILE_SCHEME = "file://"


def resolve_paths(config: TrainConfig, base: str | os.PathLike | None = None) -> TrainConfig:
    """A copy of `config` whose every path (PATH_KEYS) is absolute: a relative one taken from `base` (default: this
    process's working directory, where the command was typed), `~` expanded, `.` and `..` taken out. Symbolic links
    stay as named (`runs/latest` means whatever it points at when it is read). Idempotent: the driver resolves once,
    and a config resolved again, by a worker or another call, is unchanged."""
    base = Path(base if base is not None else os.getcwd())
    out = copy.deepcopy(config)
    for key in PATH_KEYS:
        section, name = key.split(".")
        holder = getattr(out, section)
        value = getattr(holder, name)
        if isinstance(value, list):  # data.paths entries: a path, or {path, weight}
            value = [{**v, "path": resolve_path(key, v["path"], base)} if isinstance(v, dict) and
                     isinstance(v.get("path"), str) else resolve_path(key, v, base) for v in value]
        else:
            value = resolve_path(key, value, base)
        setattr(holder, name, value)
    return out


def resolve_path(key: str, value: str, base: Path) -> str:
    """`value` of config key `key` as an absolute path from `base`, or as it is where it names no local path."""
    if not isinstance(value, str) or not names_a_path(key, value, base):
        return value
    scheme = FILE_SCHEME if value.startswith(FILE_SCHEME) else ""
    return scheme + os.path.normpath(base / Path(value.removeprefix(scheme)).expanduser())


def names_a_path(key: str, value: str, base: Path | None = None) -> bool:
    """Whether the value of `key` names a local file or directory (not "", a builtin, a preset, a template's name or
    a remote URI). A model.config that is a bare word naming nothing in `base` is a preset's name, mistyped: it is
    refused by that name on the driver (raysft.model.build.load_model_config)."""
    if not value or value.startswith(BUILTIN) or is_remote(value):
        return False
    if key == "model.config":  # the names' modules import torch and transformers: here, only where needed
        from raysft.model.build import PRESETS

        return value not in PRESETS and (os.sep in value or value.startswith(("~", ".")) or value.endswith(".json")
                                         or (base or Path.cwd()).joinpath(value).exists())
    if key == "data.chat_template":
        from raysft.data.tokenizer import CHAT_TEMPLATE_NAMES

        return value not in CHAT_TEMPLATE_NAMES
    return True


def resolve_identity(identity: dict, base: str | os.PathLike | None = None) -> dict:
    """A run's identity (the keys of raysft_run.json) with its paths resolved as resolve_paths resolves them: a run
    whose first launch recorded a relative model.path as written is the same run when launched again from the
    same directory."""
    base = Path(base if base is not None else os.getcwd())
    return {k: resolve_path(k, v, base) if k in RUN_DEFINING_PATHS else v for k, v in identity.items()}


def check_paths(config: TrainConfig) -> None:
    """On the driver, before the data is tokenized and before Ray starts: every file or directory the config names
    that must already be there is, else a ConfigError naming the key and the path (a relative path was taken from
    the directory the command runs in: resolve_paths)."""
    cwd = os.getcwd()
    for key, path, kind in _required(config, data=True):
        if not _exists(path, kind):
            path = os.path.abspath(os.path.expanduser(path))
            what = f"is not a {kind}" if os.path.lexists(path) else "does not exist"
            where = f" (a relative path is taken from {cwd}, where the command runs)" if \
                Path(path).is_relative_to(cwd) else ""
            raise ConfigError(f"config key '{key}': {path} {what}{where}")


def check_worker_paths(config: TrainConfig, stores: Sequence[Path], where: str) -> None:
    """On a Ray worker, before it reads anything: what the driver checked and the workers read (the model, the
    tokenizer, a chat template file, the tokenized stores the driver wrote) is there on this node too, else a
    ConfigError naming the key, the path and `where` (the node): every node must see them at the same path."""
    wanted = [*_required(config, data=False), *(("data.store_dir", str(s), "directory") for s in stores)]
    for key, path, kind in wanted:
        if not _exists(path, kind):
            raise ConfigError(f"config key '{key}': {path} is not a {kind} on {where}, where a Ray worker reads it, "
                              "though the driver found it: every node must see it at the same path (a shared "
                              "mount; docs/CLUSTERS.md)")


def _required(config: TrainConfig, data: bool) -> Iterator[tuple[str, str, str]]:
    """(key, path, kind) of what must exist before a launch: with `data`, the data files too (read only by the
    driver, which tokenizes them)."""
    m, d = config.model, config.data
    if m.path:
        yield "model.path", m.path, "directory"
    if names_a_path("model.tokenizer", m.tokenizer):
        yield "model.tokenizer", m.tokenizer, "directory"
    if not m.path and names_a_path("model.config", m.config):
        yield "model.config", m.config, "file or directory"
    if names_a_path("data.chat_template", d.chat_template):
        yield "data.chat_template", d.chat_template, "file"
    if data:
        for key, entries in (("data.paths", d.paths), ("data.eval_paths", d.eval_paths)):
            for i, (path, _) in enumerate(data_sources(entries, key)):
                if names_a_path(key, path):
                    yield f"{key}[{i}]", path, "file or directory"
        if names_a_path("eval.path", config.eval.path):  # read on the driver, and by the evaluation on its node
            yield "eval.path", config.eval.path, "file"


def _exists(path: str, kind: str) -> bool:
    p = Path(path).expanduser()
    return {"directory": p.is_dir(), "file": p.is_file()}.get(kind, p.exists())
