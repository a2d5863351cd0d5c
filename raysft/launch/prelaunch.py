"""What a launch does on the driver before any worker starts: the tokenized stores, the checks every worker would
fail alike (tokenizer, model files, attention, batch), and the run directory claimed with its identity.

A run is its directory `<run.storage_path>/<run.name>`, local or on remote storage (raysft.storage). Launching again
with the same name continues it, so what defines the run (the data, the model, the seed of the data order) is
recorded on the first launch and must match on every later one; `fresh` starts over and keeps the old directory
under another name. Everything else may change between launches: workers, sharding, checkpointing, and
hyperparameters such as train.max_steps (to train longer) or train.lr, which apply from the resumed step on.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import NamedTuple

from transformers import PretrainedConfig, PreTrainedTokenizerBase

from raysft.checkpoint.discovery import (
    LAUNCH_CONFIG_FILE,
    RUN_FILE,
    RUN_ID_KEY,
    SET_ASIDE_KEY,
    new_run_id,
    read_run_id,
)
from raysft.config import ConfigError, TrainConfig
from raysft.data.tokenizer import load_tokenizer
from raysft.errors import ModelDirError, WeightsFileError
from raysft.evals.engines import resolve_engine
from raysft.evals.evalset import check_renders, read_eval_set
from raysft.hf.fingerprint import changed_files, weights_fingerprint
from raysft.launch.paths import check_paths, resolve_identity
from raysft.model.attention import check_attention
from raysft.model.build import build_meta_model, check_pretrained, load_model_config
from raysft.model.lora import add_adapters
from raysft.model.loss import check_chunked_loss
from raysft.model.seeded_init import INIT_SCHEME
from raysft.parallel.sequence import check_sequence_parallel
from raysft.storage import Location, location, native
from raysft.training.objective import Objective, objective_for
from raysft.training.trackers import check_trackers

# Without these, a checkpoint's weights and data cursor would mean something else: another model, or another order
# of the samples (the seed), so samples would be skipped or seen twice.
RUN_DEFINING_KEYS = ("model.path", "model.config", "model.tokenizer", "train.seed")
DATA_KEY = "data"  # the tokenized store's fingerprint: data files' contents, tokenizer, template, length
INIT_KEY = "model.init"  # the seeded initialization's scheme, for a run whose base is rebuilt from the seed
WEIGHTS_KEY = "model.weights"  # the fingerprint of model.path's files (raysft.hf.fingerprint)


class Stores(NamedTuple):
    """The tokenized stores a launch reads: training, and validation (None without data.eval_paths/eval_fraction);
    and the training store's samples (DPO: pairs), which train.num_epochs counts in (`with_max_steps`)."""

    train: Path
    eval: Path | None = None
    train_samples: int = 0


def prepare_launch(config: TrainConfig, fresh: bool = False) -> Stores:
    """On the driver (rank 0 without Ray), before any worker starts: tokenize the data or reuse its stores, check
    what would fail the same way on every worker and every restart, and claim the run directory. The config's paths
    are absolute already (raysft.launch.paths.resolve_paths)."""
    check_paths(config)  # each file or directory it names, by its key, before anything reads one
    check_trackers(config)
    tokenizer = load_tokenizer(config.model, config.data.chat_template)
    check_model(config, tokenizer)  # its files are read before the data is tokenized, which may take long
    if config.eval.path:  # so is the eval set: a bad record is named before anything is written
        check_eval_set(config, tokenizer)
    objective = objective_for(config)  # what a sample is, and the store tokenized for it
    store = objective.prepare_store(tokenizer, before_writing=None if fresh else functools.partial(
        refuse_before_writing, config))
    print(f"raysft: data store {store.path} ({store.num_samples} samples{', reused' if store.reused else ''})",
          flush=True)
    eval_store = None
    if config.data.eval_paths or config.data.eval_fraction:
        eval_store = objective.prepare_store(tokenizer, split="eval")
        print(f"raysft: eval store {eval_store.path} ({eval_store.num_samples} samples"
              f"{', reused' if eval_store.reused else ''})", flush=True)
    check_batch(config, objective, store.num_samples)
    stores = Stores(store.path, eval_store.path if eval_store else None, objective.samples_in(store.num_samples))
    launched = with_max_steps(config, stores)  # train.num_epochs in steps: refused here, before the run is claimed
    if config.train.num_epochs:
        print(f"raysft: train.num_epochs={config.train.num_epochs:g}: {launched.train.max_steps} steps of "
              f"{config.train.global_batch_size} of the {stores.train_samples} {objective.sample}", flush=True)
    moved = claim_run_dir(config, store.path.name, fresh)
    if moved:
        print(f"raysft: --fresh: the previous run is kept in {moved}", flush=True)
    # what this launch was given, for what reads the run later (`raysft export --checkpoint best`: best_metric)
    (location(config.run_dir) / LAUNCH_CONFIG_FILE).write_text(json.dumps(launched.to_dict(), indent=1))
    return stores


def with_max_steps(config: TrainConfig, stores: Stores) -> TrainConfig:
    """The config of this launch with train.num_epochs as optimizer steps over the training store: each step takes
    train.global_batch_size samples (DPO: pairs) from the one global data cursor, whatever the data-parallel width,
    micro-batches, gradient accumulation or packing (raysft.data.dataloader.GlobalBatchSampler), and an epoch's last
    partial batch is dropped, so an epoch is samples // global_batch_size steps; max_steps is num_epochs of them,
    rounded, at least 1. The LR schedule, the progress lines and the checkpoint cadence's end are laid out on it.
    The config itself without num_epochs. Every launch of a run derives the same steps: its data cannot change."""
    t = config.train
    if not t.num_epochs:
        return config
    per_epoch = stores.train_samples // t.global_batch_size
    max_steps = max(1, round(t.num_epochs * per_epoch))
    if t.stop_at_step > max_steps:
        raise ConfigError(f"config key 'train.stop_at_step': {t.stop_at_step} is past the run's end, step "
                          f"{max_steps} (train.num_epochs={t.num_epochs:g} of {per_epoch} steps)")
    return dataclasses.replace(config, train=dataclasses.replace(t, max_steps=max_steps))


def check_eval_set(config: TrainConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """The generation evaluation's eval set, every record of it (raysft.evals.evalset), and its prompts rendered
    with the chat template training uses: a bad record is a DataError naming the file and line now, not a failed
    evaluation of every checkpoint."""
    e = config.eval
    samples = read_eval_set(e.path, e.scorers, config.data.system_prompt, e.max_samples)
    check_renders(samples, tokenizer, e.path)
    print(f"raysft: eval set {e.path} ({len(samples)} prompts; scorers {', '.join(e.scorers)}; engine "
          f"{resolve_engine(e)})", flush=True)


def check_model(config: TrainConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """The model's directory (its files checked, raysft.hf.files) or config, its vocabulary against the tokenizer,
    the LoRA targets and model.path's weights: errors that would otherwise meet every worker and be retried
    scaling.max_failures times."""
    hf_config = load_model_config(config.model, tokenizer)
    check_architecture(config, hf_config)
    if config.model.path:
        check_weights(config, hf_config)


def check_architecture(config: TrainConfig, hf_config: PretrainedConfig) -> None:
    """What the configuration must agree with in the model's architecture, from its config alone (no weights, no
    tokenizer, no data): attention, the chunked loss, sequence parallelism, the LoRA targets. `raysft plan` runs
    these too, so that it plans nothing a launch would refuse."""
    check_attention(hf_config, config.model.attn_implementation, config.data.max_seq_len)
    if config.train.loss_chunk_tokens:
        check_chunked_loss(hf_config)
    check_sequence_parallel(config, hf_config)
    if config.model.lora.r:  # on the meta device, not in the workers: target_modules that name no layer
        add_adapters(build_meta_model(hf_config, config.model.attn_implementation), config.model.lora)


def check_weights(config: TrainConfig, hf_config: PretrainedConfig) -> None:
    """Every tensor of the model in model.path's files, with its shape and a dtype the workers' read converts
    (headers only, against the model on the meta device)."""
    model = add_adapters(build_meta_model(hf_config, config.model.attn_implementation), config.model.lora)
    try:
        check_pretrained(model, Path(config.model.path).expanduser())
    except (WeightsFileError, ModelDirError) as e:
        raise ConfigError(f"config key 'model.path': {e}") from None


def check_batch(config: TrainConfig, objective: Objective, rows: int) -> None:
    """A global batch from a store of `rows` rows: the objective's samples (SFT's samples, DPO's pairs)."""
    num_samples = objective.samples_in(rows)
    if num_samples < config.train.global_batch_size:
        raise ConfigError(f"config key 'train.global_batch_size': {config.train.global_batch_size} {objective.sample} "
                          f"per step, but the data has {num_samples}: lower it or add data")


def claim_run_dir(config: TrainConfig, data_fingerprint: str, fresh: bool = False) -> Path | Location | None:
    """Check that this launch may use the run directory, and record what defines the run on first use.

    Returns where an existing run was moved to with `fresh`, else None. Raises ConfigError, before anything is
    written, when the run exists and was started with other run-defining settings, or when the directory holds
    files but no raysft_run.json: raysft writes into, and `fresh` moves, only a directory raysft created.
    """
    run_dir = location(config.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run directory {run_dir} exists and is not a directory: pick another run.name")
    if run_dir.children() and not (run_dir / RUN_FILE).is_file():
        raise ConfigError(
            f"{run_dir} exists and is not a raysft run directory (no {RUN_FILE}); raysft neither writes into nor "
            "moves (--fresh) a directory it did not create: pick another run.name or run.storage_path")
    moved, set_aside = None, []
    if fresh and run_dir.children():
        moved = run_dir.with_name(f"{run_dir.name}.replaced-{time.strftime('%Y%m%dT%H%M%S')}")
        run_dir.move_dir(moved)
        if (moved / RUN_FILE).is_file():  # its snapshots in node memory are set aside with it
            set_aside = [read_run_id(moved)]
    identity = resolve_identity(run_identity(config, data_fingerprint))
    path = run_dir / RUN_FILE
    if path.is_file():
        recorded = resolve_identity(json.loads(path.read_text()))  # a relative model.path of an older raysft
        if WEIGHTS_KEY not in recorded:  # started by a raysft that did not fingerprint the base: nothing to compare
            identity.pop(WEIGHTS_KEY, None)
        changed = [k for k in {**recorded, **identity}
                   if k not in (RUN_ID_KEY, SET_ASIDE_KEY) and recorded.get(k) != identity.get(k)]
        if len(changed) > 1 and INIT_KEY in changed:  # it follows model.lora or model.path: those are named
            changed.remove(INIT_KEY)
        if "model.path" in changed and WEIGHTS_KEY in changed:  # another directory: named as such
            changed.remove(WEIGHTS_KEY)
        if changed:
            key = changed[0]
            what = ("the training data (the contents of data.paths, the tokenizer, the chat template or "
                    "data.max_seq_len) differs" if key == DATA_KEY else
                    f"the weights at model.path {config.model.path} are not those it started from: "
                    f"{', '.join(changed_files(recorded[key], identity[key]))} (by size, header and sampled bytes)"
                    if key == WEIGHTS_KEY else
                    f"it was started with {key}={recorded.get(key)!r}, this launch has {identity.get(key)!r}")
            if key == INIT_KEY:
                what += (" (the seeded initialization of its from-scratch LoRA base: the base this raysft builds "
                         "from train.seed is not the one its adapters were trained on)")
            raise ConfigError(
                f"run '{config.run.name}' in {run_dir} exists and {what}; launching again continues a run, so "
                f"{', '.join(changed)} must match. Keep the run's settings, pick another run.name, or start over "
                f"with --fresh, which sets the whole run aside: its directory is kept beside it as "
                f"{run_dir.name}.replaced-<time>, and its snapshots in node memory (checkpoint.memory_dir) are "
                "reclaimed")
        return native(moved) if moved else None
    run_dir.mkdir()
    record = {**identity, RUN_ID_KEY: new_run_id(), **({SET_ASIDE_KEY: set_aside} if set_aside else {})}
    path.write_text(json.dumps(record, indent=1))
    return native(moved) if moved else None


def refuse_before_writing(config: TrainConfig, data_fingerprint: str) -> None:
    """What claim_run_dir will refuse, asked before a new store is tokenized, so that a relaunch with other data
    (another data.max_seq_len, say) writes nothing. Reads only: claim_run_dir writes only into a directory that
    is new or empty, and here it is asked only of one that exists and is not empty."""
    run_dir = location(config.run_dir)
    if run_dir.exists() and (not run_dir.is_dir() or run_dir.children()):
        claim_run_dir(config, data_fingerprint)


def run_identity(config: TrainConfig, data_fingerprint: str) -> dict:
    """What must match on every launch. The base weights at model.path, by a fingerprint of their files
    (WEIGHTS_KEY, raysft.hf.fingerprint): other weights of the same shapes put there would be trained on silently,
    as a LoRA run's frozen base on every launch, and by a full fine-tuning run relaunched before its first
    checkpoint (whose checkpoints are then of another base than the run's). LoRA trains other weights: its
    settings define the run (absent: full fine-tuning). A LoRA run from scratch rebuilds its frozen base from
    train.seed on every launch, so the scheme of that seeded initialization defines it too (INIT_KEY): a run
    started under another scheme is refused, its adapters being trained on other base weights. A full fine-tuning
    run resumes its weights from its checkpoint, whatever the scheme."""
    values = config.to_dict()
    identity = {DATA_KEY: data_fingerprint}
    for key in RUN_DEFINING_KEYS:
        section, name = key.split(".")
        identity[key] = values[section][name]
    identity.update(objective_for(config).identity())
    if config.model.lora.r:
        identity["model.lora"] = values["model"]["lora"]
        if not config.model.path:
            identity[INIT_KEY] = INIT_SCHEME
    if config.model.path:
        identity[WEIGHTS_KEY] = weights_fingerprint(Path(config.model.path).expanduser())
    return identity
