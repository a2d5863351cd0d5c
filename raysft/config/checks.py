"""The checks a configuration must pass beyond its types: ranges, values that must agree with each other, files
that must exist, optional libraries that must be installed. raysft.config.load runs them once on every configuration
it reads, so a mistake fails on the driver with the key's name, before any worker starts."""

from __future__ import annotations

import math
import os
import re

from raysft.config.gen_eval import SCORERS, GenEvalConfig
from raysft.config.sections import (
    ATTN_IMPLEMENTATIONS,
    BUILTIN,
    TRACKERS,
    CheckpointConfig,
    DataConfig,
    LoraConfig,
    MetricsConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    ScalingConfig,
    TrainConfig,
    TrainLoopConfig,
)
from raysft.distributed.layout import ParallelDims
from raysft.errors import ConfigError
from raysft.storage import is_remote


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}': {message}")


def _compiles(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


def validate(cfg: TrainConfig) -> None:
    """Each section's checks, then those that join sections; type checks happen while loading."""
    check_train(cfg.train)
    check_scaling(cfg.scaling)
    check_checkpoint(cfg.checkpoint)
    check_data(cfg.data)
    check_parallel(cfg.parallel)
    check_model(cfg.model)
    check_run(cfg.run)
    check_metrics(cfg.metrics)
    check_gen_eval(cfg.eval)
    _validate_batch(cfg)
    _validate_eval(cfg)
    _validate_dpo(cfg)
    _validate_fp8(cfg)
    _validate_storage(cfg)
    _validate_live(cfg)


def check_train(t: TrainLoopConfig) -> None:
    _require(t.max_steps > 0, "train.max_steps", f"must be > 0, got {t.max_steps}")
    _require(t.num_epochs >= 0, "train.num_epochs", f"must be >= 0, got {t.num_epochs}")
    _require(t.stop_at_step >= 0 and (t.num_epochs > 0 or t.stop_at_step <= t.max_steps), "train.stop_at_step",
             f"must be in [0, train.max_steps={t.max_steps}], got {t.stop_at_step}")  # num_epochs: once in steps
    _require(t.micro_batch_size > 0, "train.micro_batch_size", f"must be > 0, got {t.micro_batch_size}")
    _require(t.micro_batch_tokens >= 0, "train.micro_batch_tokens", f"must be >= 0, got {t.micro_batch_tokens}")
    _require(t.loss_chunk_tokens >= 0, "train.loss_chunk_tokens", f"must be >= 0, got {t.loss_chunk_tokens}")
    _require(t.warmup_steps >= 0, "train.warmup_steps", f"must be >= 0, got {t.warmup_steps}")
    _require(t.schedule_steps >= 0, "train.schedule_steps", f"must be >= 0, got {t.schedule_steps}")
    _require(0.0 <= t.min_lr_ratio <= 1.0, "train.min_lr_ratio", f"must be in [0, 1], got {t.min_lr_ratio}")
    _require(t.lr > 0, "train.lr", f"must be > 0, got {t.lr}")
    _require(t.weight_decay >= 0, "train.weight_decay", f"must be >= 0, got {t.weight_decay}")
    _require(t.grad_clip > 0, "train.grad_clip",
             f"must be > 0 (the largest gradient norm kept; 0 would stop learning), got {t.grad_clip}")
    _require(t.eps > 0, "train.eps", f"must be > 0, got {t.eps}")
    for pattern in t.weight_decay_exclude:
        _require(_compiles(pattern), "train.weight_decay_exclude", f"{pattern!r} is not a regular expression")
    _require(len(t.betas) == 2 and all(0 <= b < 1 for b in t.betas), "train.betas",
             f"must be two values in [0, 1), got {t.betas}")
    _require(t.max_skipped_steps >= 0, "train.max_skipped_steps",
             f"must be >= 0 (0: never stop), got {t.max_skipped_steps}")
    _require(t.loss_spike_factor == 0 or t.loss_spike_factor > 1, "train.loss_spike_factor",
             f"must be 0 (off) or > 1 (a multiple of the median loss), got {t.loss_spike_factor}")
    _require(t.log_every_n_steps > 0, "train.log_every_n_steps", f"must be > 0, got {t.log_every_n_steps}")
    _require(t.report_every_n_steps >= 0, "train.report_every_n_steps", f"must be >= 0, got {t.report_every_n_steps}")
    _require(t.eval_every_n_steps >= 0, "train.eval_every_n_steps", f"must be >= 0, got {t.eval_every_n_steps}")


def check_scaling(s: ScalingConfig) -> None:
    _require(s.num_workers > 0, "scaling.num_workers", f"must be > 0, got {s.num_workers}")
    _require(0 <= s.min_workers <= s.num_workers, "scaling.min_workers",
             f"must be in [0, scaling.num_workers={s.num_workers}], got {s.min_workers}")
    _require(math.isfinite(s.resize_interval_s) and s.resize_interval_s > 0, "scaling.resize_interval_s",
             f"must be a finite number of seconds > 0, got {s.resize_interval_s}")
    _require(s.cpus_per_worker > 0, "scaling.cpus_per_worker", f"must be > 0, got {s.cpus_per_worker}")
    _require(s.placement_timeout_s > 0, "scaling.placement_timeout_s", f"must be > 0, got {s.placement_timeout_s}")
    _require(s.max_failures >= -1, "scaling.max_failures", f"must be >= -1, got {s.max_failures}")


def check_gen_eval(e: GenEvalConfig) -> None:
    """The generation evaluation's values (the eval set's records are checked on the driver before a launch:
    raysft.launch.prelaunch)."""
    _require(bool(e.scorers), "eval.scorers", f"needs at least one of {', '.join(SCORERS)}")
    unknown = [name for name in e.scorers if name not in SCORERS]
    _require(not unknown, "eval.scorers", f"{unknown[0] if unknown else ''!r} is not one of {', '.join(SCORERS)}")
    _require(len(set(e.scorers)) == len(e.scorers), "eval.scorers", f"lists a scorer twice: {e.scorers}")
    if "regex" in e.scorers or e.answer_pattern:
        _require(bool(e.answer_pattern), "eval.answer_pattern", "the regex scorer needs a regular expression")
        _require(_compiles(e.answer_pattern), "eval.answer_pattern",
                 f"{e.answer_pattern!r} is not a regular expression")
        _require("regex" in e.scorers, "eval.answer_pattern", "is the regex scorer's: add regex to eval.scorers")
    _require(e.max_new_tokens > 0, "eval.max_new_tokens", f"must be > 0, got {e.max_new_tokens}")
    _require(e.temperature >= 0, "eval.temperature", f"must be >= 0 (0: greedy), got {e.temperature}")
    _require(e.max_samples >= 0, "eval.max_samples", f"must be >= 0 (0: all), got {e.max_samples}")
    _require(e.batch_size > 0, "eval.batch_size", f"must be > 0, got {e.batch_size}")
    _require(all(isinstance(s, str) and s for s in e.stop), "eval.stop", f"must be non-empty strings, got {e.stop}")
    _require(e.num_cpus > 0, "eval.num_cpus", f"must be > 0, got {e.num_cpus}")
    _require(e.num_gpus >= 0, "eval.num_gpus", f"must be >= 0, got {e.num_gpus}")
    _require(e.timeout_s > 0, "eval.timeout_s", f"must be > 0 seconds, got {e.timeout_s}")
    _require(e.engine != "vllm" or e.num_gpus >= 1, "eval.engine",
             f"vllm runs its engine on GPUs: set eval.num_gpus >= 1 (its tensor-parallel size), got {e.num_gpus}")
    _require(not is_remote(e.path), "eval.path",
             f"must be a file every node can read (a local or shared path), got the URI {e.path!r}")


def check_checkpoint(c: CheckpointConfig) -> None:
    _require(c.every_n_steps > 0, "checkpoint.every_n_steps", f"must be > 0, got {c.every_n_steps}")
    _require(c.keep >= 1, "checkpoint.keep", f"must be >= 1, got {c.keep}")
    _require(c.keep_best >= 0, "checkpoint.keep_best", f"must be >= 0, got {c.keep_best}")
    _require(c.memory_every_n_steps >= 0, "checkpoint.memory_every_n_steps",
             f"must be >= 0 (0: no memory tier), got {c.memory_every_n_steps}")
    _require(math.isfinite(c.memory_copy_mb_per_s) and c.memory_copy_mb_per_s >= 0, "checkpoint.memory_copy_mb_per_s",
             f"must be a finite rate >= 0 (0: unbounded), got {c.memory_copy_mb_per_s}")
    _require(not is_remote(c.memory_dir), "checkpoint.memory_dir",
             f"must be a local directory (node-local shared memory, such as /dev/shm/raysft-me; empty: "
             f"/dev/shm/raysft-<uid>), got {c.memory_dir!r}")
    _require(math.isfinite(c.memory_timeout_s) and c.memory_timeout_s > 0, "checkpoint.memory_timeout_s",
             f"must be a finite number of seconds > 0, got {c.memory_timeout_s}")


def check_data(d: DataConfig) -> None:
    _require(d.max_seq_len >= 2, "data.max_seq_len", f"must be >= 2, got {d.max_seq_len}")
    _require(len(d.paths) > 0, "data.paths", "needs at least one file")
    _require(0.0 <= d.eval_fraction < 1.0, "data.eval_fraction", f"must be in [0, 1), got {d.eval_fraction}")
    _require(not (d.eval_paths and d.eval_fraction), "data.eval_fraction",
             "set data.eval_paths or data.eval_fraction, not both")
    seen: dict[str, str] = {}
    for path, _ in data_sources(d.paths):  # the same file twice would silently double its samples
        same = _same_file(path)
        _require(same not in seen, "data.paths", f"lists {seen.get(same)!r} and {path!r}, the same file twice (a "
                 "weight samples a source more or less often: {path: ..., weight: w})")
        seen[same] = path
    for path, _ in data_sources(d.eval_paths, "data.eval_paths"):
        _require(_same_file(path) not in seen, "data.eval_paths",
                 f"{path!r} is also in data.paths: validation on training records measures nothing (use "
                 "data.eval_fraction to hold records of a training file out)")


def check_parallel(p: ParallelConfig) -> None:
    """What needs no worker count; the layout is checked for each (ParallelDims.check_config)."""
    _require(p.sequence_parallel >= 1, "parallel.sequence_parallel",
             f"must be >= 1 (1: off), got {p.sequence_parallel}")
    _require(p.fp16_init_scale > 0, "parallel.fp16_init_scale", f"must be > 0, got {p.fp16_init_scale}")
    ac = p.activation_checkpointing
    _require(ac in ("none", "full") or (ac.isdigit() and int(ac) > 0), "parallel.activation_checkpointing",
             f"must be 'none', 'full' or a positive integer k (every k-th layer), got {ac!r}")


def check_model(m: ModelConfig) -> None:
    _require(bool(m.path or m.config), "model.config", "set model.path (fine-tune) or model.config (from scratch)")
    _require(bool(m.tokenizer or m.path), "model.tokenizer", "no tokenizer: set model.tokenizer or model.path")
    _validate_attention(m.attn_implementation)
    _validate_lora(m.lora)


def check_run(r: RunConfig) -> None:
    _require(r.stop_grace_s > 0, "run.stop_grace_s", f"must be > 0 seconds, got {r.stop_grace_s}")
    _require(is_plain_name(r.name), "run.name",
             f"must be a plain directory name (not '.' or '..', no path separator), got {r.name!r}: "
             "the run directory is always a child of run.storage_path")


def check_metrics(m: MetricsConfig) -> None:
    unknown = [name for name in m.trackers if name not in TRACKERS]
    _require(not unknown, "metrics.trackers", f"{unknown[0] if unknown else ''!r} is not one of {', '.join(TRACKERS)}")


def _validate_batch(cfg: TrainConfig) -> None:
    """The batch against the parallel layout for every worker count Ray may pick (scaling.min_workers: elastic): a
    step's samples are dealt over the layout's data-parallel groups."""
    t, s, d = cfg.train, cfg.scaling, cfg.data
    if t.micro_batch_tokens:
        _require(d.packing, "train.micro_batch_tokens", "needs data.packing: true (padded batches are cut by samples)")
        _require(t.micro_batch_tokens >= d.max_seq_len, "train.micro_batch_tokens",
                 f"{t.micro_batch_tokens} is less than data.max_seq_len={d.max_seq_len}")
    _require(cfg.model.attn_implementation != "varlen" or d.packing, "model.attn_implementation",
             "'varlen' needs data.packing: true (it takes the sample boundaries of packed rows)")
    n = cfg.parallel.sequence_parallel
    for workers in range(s.min_workers or s.num_workers, s.num_workers + 1):  # elastic: every size Ray may pick
        groups = ParallelDims.check_config(cfg.parallel, workers)  # the N workers of a sequence group: one group
        per_step = (1 if t.micro_batch_tokens else t.micro_batch_size) * groups
        takers = f"workers ({workers})" if n == 1 else f"data-parallel groups ({workers} workers / {n} = {groups})"
        _require(
            t.global_batch_size > 0 and t.global_batch_size % per_step == 0,
            "train.global_batch_size",
            (f"{t.global_batch_size} must be a positive multiple of the {takers}: with train.micro_batch_tokens "
             "every one takes as many samples" if t.micro_batch_tokens else
             f"{t.global_batch_size} must be a positive multiple of train.micro_batch_size × {takers} "
             f"= {t.micro_batch_size} × {groups} = {per_step}")
            + (f" (scaling.min_workers={s.min_workers}: every worker count up to {s.num_workers} must divide it)"
               if s.min_workers else ""),
        )


def _validate_eval(cfg: TrainConfig) -> None:
    """Validation needs validation data (data.eval_paths or data.eval_fraction); checkpoint.keep_best ranks by a
    metric that some evaluation of the run produces: the validation pass (eval_loss, eval/...) or the generation
    evaluation (gen/<scorer> of eval.scorers)."""
    d, t, c = cfg.data, cfg.train, cfg.checkpoint
    has_eval = bool(d.eval_paths or d.eval_fraction)
    _require(has_eval or not t.eval_every_n_steps, "train.eval_every_n_steps",
             "needs validation data: set data.eval_paths or data.eval_fraction")
    metric = c.best_metric
    if metric.startswith("gen/"):
        scorer = metric.removeprefix("gen/")
        _require(scorer in SCORERS, "checkpoint.best_metric",
                 f"{metric!r}: a generation score is gen/<scorer>, one of {', '.join('gen/' + s for s in SCORERS)}")
        _require(not c.keep_best or bool(cfg.eval.path), "checkpoint.keep_best",
                 f"ranks checkpoints by {metric}, a generation score: set eval.path")
        _require(not c.keep_best or scorer in cfg.eval.scorers, "checkpoint.best_metric",
                 f"{metric} ranks by the {scorer} scorer, which eval.scorers {cfg.eval.scorers} does not run")
        return
    dpo_metrics = [f"eval/{m}" for m in ("rewards/accuracies", "rewards/margins", "rewards/chosen",
                                         "rewards/rejected")]
    known = ["eval_loss", *(dpo_metrics if t.objective == "dpo" else [])]
    _require(metric in known, "checkpoint.best_metric",
             f"{metric!r} is not a metric of this run's evaluations: one of {', '.join(known)} or gen/<scorer>")
    _require(has_eval or not c.keep_best, "checkpoint.keep_best",
             f"ranks checkpoints by {metric}: set data.eval_paths or data.eval_fraction")


def best_mode(c: CheckpointConfig) -> str:
    """"min" or "max": checkpoint.best_mode, or for auto, min for a metric named ...loss, else max."""
    if c.best_mode != "auto":
        return c.best_mode
    return "min" if c.best_metric.endswith("loss") else "max"


def _validate_dpo(cfg: TrainConfig) -> None:
    """The preference objective's values, and what it does not combine with."""
    o = cfg.dpo
    _require(o.beta > 0, "dpo.beta", f"must be > 0, got {o.beta}")
    _require(o.sft_weight >= 0, "dpo.sft_weight", f"must be >= 0 (0: off), got {o.sft_weight}")
    if cfg.train.objective != "dpo":
        return
    _require(cfg.parallel.sequence_parallel == 1, "parallel.sequence_parallel",
             "train.objective dpo sums each answer's log-probabilities over the whole sequence on one worker: "
             "set parallel.sequence_parallel: 1")


def _validate_fp8(cfg: TrainConfig) -> None:
    """FP8 needs torchao where the configuration is loaded too, and trains every converted weight: not with LoRA's
    frozen base (and its adapters would be converted with it). The device is checked in the workers
    (raysft.parallel.fp8.require_fp8)."""
    if not cfg.parallel.fp8:
        return
    import importlib.util

    _require(importlib.util.find_spec("torchao") is not None, "parallel.fp8",
             "FP8 training needs torchao, which is not installed: pip install 'raysft[fp8]' (or set parallel.fp8: "
             "false)")
    _require(not cfg.model.lora.r, "parallel.fp8",
             f"FP8 training converts the weights that full fine-tuning trains; with model.lora.r={cfg.model.lora.r} "
             "the base is frozen: set parallel.fp8: false or model.lora.r: 0")


def data_sources(paths: list[str | dict], name: str = "data.paths") -> list[tuple[str, float]]:
    """(path, weight) of every data.paths entry: a path (weight 1), or {path, weight} with a finite weight > 0."""
    sources = []
    for i, entry in enumerate(paths):
        key = f"{name}[{i}]"
        if isinstance(entry, str):
            sources.append((entry, 1.0))
            continue
        unknown = sorted(set(entry) - {"path", "weight"})
        _require(not unknown, key, f"unknown key {unknown[0] if unknown else ''!r} (an entry is a path, or "
                 "{path: ..., weight: w})")
        path, weight = entry.get("path"), entry.get("weight", 1.0)
        _require(isinstance(path, str) and bool(path), key, f"needs a 'path', got {entry!r}")
        _require(isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight)
                 and weight > 0, key, f"weight must be a finite number > 0, got {weight!r}")
        sources.append((path, float(weight)))
    return sources


def _same_file(path: str) -> str:
    return path if path.startswith(BUILTIN) else os.path.realpath(os.path.expanduser(path))


def is_plain_name(name: str) -> bool:
    """A single path component that names a child of its parent: not empty, `.` or `..`, no separator."""
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0")


def _validate_attention(name: str) -> None:
    """An unknown name would fail in every worker after Ray started them (or, written `org/repo`, make transformers
    fetch a kernel from the hub): refuse it here."""
    from transformers import AttentionInterface

    known = {*ATTN_IMPLEMENTATIONS, *AttentionInterface().valid_keys()}  # registered ones, built-in or added
    _require(name in known, "model.attn_implementation", f"{name!r} is not one of {', '.join(sorted(known))}")


def _validate_storage(cfg: TrainConfig) -> None:
    """Checkpoints, metrics and run files go to any pyarrow filesystem; the tokenized store is read by every worker
    as local files, so it needs a directory that every node mounts."""
    store, storage = cfg.data.store_dir, cfg.run.storage_path
    _require(not is_remote(store), "data.store_dir",
             f"must be a filesystem path every node can read (NFS or another shared mount), got the URI {store!r}")
    _require(bool(store) or not is_remote(storage), "data.store_dir",
             f"run.storage_path is {storage!r}, so the tokenized store cannot default to <run.storage_path>/datasets:"
             " set data.store_dir to a directory every node can read (NFS or another shared mount; a local "
             "directory only works when the driver and all workers are on one machine)")


def _validate_lora(lora: LoraConfig) -> None:
    _require(lora.r >= 0, "model.lora.r", f"must be >= 0 (0: full fine-tuning), got {lora.r}")
    if not lora.r:
        return
    _require(lora.alpha > 0, "model.lora.alpha", f"must be > 0, got {lora.alpha}")
    _require(0 <= lora.dropout < 1, "model.lora.dropout", f"must be in [0, 1), got {lora.dropout}")
    _require(bool(lora.target_modules), "model.lora.target_modules", "needs at least one module name")
    import importlib.util

    _require(importlib.util.find_spec("peft") is not None, "model.lora",
             "LoRA needs peft, which is not installed: pip install 'raysft[lora]' (or set model.lora.r: 0)")


def _validate_live(cfg: TrainConfig) -> None:
    """Live fault tolerance: replica groups of one worker each, which hold the whole model, train one quorum's
    steps and register checkpoints only when every group is present; what needs more of Ray is refused."""
    v = cfg.live
    _require(v.heartbeat_timeout_ms > 0, "live.heartbeat_timeout_ms", f"must be > 0, got {v.heartbeat_timeout_ms}")
    _require(v.join_timeout_ms >= 0, "live.join_timeout_ms", f"must be >= 0, got {v.join_timeout_ms}")
    for key, seconds in (("live.timeout_s", v.timeout_s), ("live.quorum_timeout_s", v.quorum_timeout_s)):
        _require(math.isfinite(seconds) and seconds > 0, key, f"must be a finite number of seconds > 0, got {seconds}")
    if not v.enabled:
        return
    refusals = (
        ("scaling.num_workers", cfg.scaling.num_workers >= 2, "live.enabled needs at least 2 workers (replica groups)"),
        ("scaling.min_workers", not cfg.scaling.min_workers,
         "live.enabled keeps the width: Ray replaces a lost worker rather than resizing (set 0)"),
        ("parallel.sharding", cfg.parallel.sharding != "HYBRID_SHARD",
         "live.enabled makes every worker a replica group of one: there are no nodes to shard within"),
        ("parallel.sequence_parallel", cfg.parallel.sequence_parallel == 1,
         "live.enabled makes every worker a replica group of one: set 1"),
        ("train.objective", cfg.train.objective == "sft", "live.enabled trains the sft objective only"),
        ("checkpoint.memory_every_n_steps", not cfg.checkpoint.memory_every_n_steps,
         "live.enabled heals a replaced worker from a live one, not from the memory tier: set 0"),
        ("eval.path", not cfg.eval.path,
         "live.enabled registers checkpoints with Ray only at the end of a launch, so none could be evaluated "
         "while training: evaluate them afterwards with `raysft eval`"),
        ("run.storage_path", not is_remote(cfg.run.storage_path),
         "live.enabled writes checkpoints straight into the run directory: a local or shared (NFS) path"),
        ("parallel.cpu_offload", not cfg.parallel.cpu_offload,
         "live.enabled all-reduces the gradients on the device across the groups: set false"),
        ("metrics.trackers", not cfg.metrics.trackers,
         "live.enabled logs to metrics.jsonl only (every group would open a tracker run of its own): set []"),
    )
    for key, ok, why in refusals:
        _require(ok, key, why)

