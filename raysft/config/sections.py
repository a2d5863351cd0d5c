"""Typed run configuration: one small dataclass per component, composed into TrainConfig.

These classes say what can be configured and nothing more: reading YAML and overrides into them is
raysft.config.load, the checks each value must pass are raysft.config.checks, so that this module, which nearly
every other imports, imports nothing of raysft above the storage helpers.
The defaults are the embedded demo: a tiny LLaMA trained from scratch on the bundled conversations.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from raysft.config.gen_eval import GenEvalConfig
from raysft.config.live import LiveConfig
from raysft.storage import Location, location, native

BUILTIN = "builtin:"  # prefix of assets shipped inside the package, e.g. "builtin:demo"
# The names of the dtypes a run computes in and an export writes (raysft.hf.dtypes gives each its torch dtype).
Precision = Literal["fp32", "bf16", "fp16"]
# train.loss_spike_factor's rule (raysft.training.step_guard): a spike is measured against the median loss of this
# many recent applied steps, once this many have been applied (the first losses fall fast). A checkpoint holds those
# losses (raysft.checkpoint.state), so the window bounds what a sound one holds.
LOSS_SPIKE_WINDOW = 32
LOSS_SPIKE_MIN_HISTORY = 8


@dataclass
class LoraConfig:
    r: int = 0
    """LoRA rank (peft): train rank-r adapters on target_modules, the base weights frozen; 0: full fine-tuning."""
    alpha: float = 16.0
    """Adapter scale numerator: the update is (alpha / r) · B·A."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""
    target_modules: list[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Names of the linear layers that get adapters (peft's target_modules)."""


@dataclass
class ModelConfig:
    path: str = ""
    """Local Hugging Face directory (config.json + safetensors) to fine-tune. Empty: train from scratch. Its files
    are checked on the driver (raysft.hf.files); one whose config asks for code of its own (auto_map) is refused:
    no code from a model directory runs. Every worker reads its own slices of the weights from these files, so the
    directory must be readable at this path on every node (a shared mount)."""
    config: str = "demo-tiny"
    """From-scratch architecture: a preset name (see raysft.model.build.PRESETS) or a config.json / directory."""
    tokenizer: str = "builtin:demo"
    """Tokenizer directory; empty means `path`. "builtin:demo" is the byte-level BPE shipped for the demo."""
    attn_implementation: str = "sdpa"
    """transformers' attention kernel: one of ATTN_IMPLEMENTATIONS ("sdpa", "eager", "flex_attention",
    "flash_attention_2" if installed, or "varlen": raysft's padding-free attention for data.packing, flash varlen
    from torch on CUDA in bf16/fp16, per-sample SDPA elsewhere) or a name registered with transformers'
    AttentionInterface. One that would not attend as the model does is refused: varlen with the model's
    sliding_window shorter than data.max_seq_len, varlen or sdpa with its attn_logit_softcapping."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (raysft.model.lora); needs `pip install 'raysft[lora]'`."""


@dataclass
class DataConfig:
    paths: list[str | dict] = field(default_factory=lambda: ["builtin:demo"])
    """ShareGPT/FastChat or OpenAI-messages conversations: .json arrays, .jsonl, .parquet, or Hugging Face datasets
    saved with save_to_disk (rows with `messages` or `conversations`); "builtin:demo" is the bundled set. An entry
    may be {path: ..., weight: w}: the source goes into the store w times over (0.5: about half its records, 2:
    each twice), the same records on every run. With train.objective dpo: preference pairs (docs/DPO.md)."""
    system_prompt: str = ""
    """A system message for the conversations that have none ("": none added)."""
    eval_paths: list[str | dict] = field(default_factory=list)
    """Validation conversations, in the formats of `paths`, tokenized into a store of their own."""
    eval_fraction: float = 0.0
    """Instead of eval_paths: hold this share of the records of `paths` out of training for validation (the same
    records on every run, chosen by each source's content hash and record index; none is in both)."""
    chat_template: str = "auto"
    """"auto": the tokenizer's own (Vicuna v1.1 if it has none); "vicuna"; or a path to a .jinja file."""
    max_seq_len: int = 512
    """Longer conversations are truncated; batches are padded only to their longest sample."""
    train_on: Literal["all_assistant", "last_assistant"] = "all_assistant"
    """Which assistant turns are supervised: every one, or only the conversation's last (its final answer). Labels
    are each turn's text as the chat template renders it plus the end-of-turn token written right after it."""
    on_bad_record: Literal["error", "skip"] = "error"
    """"skip": drop bad records and count them per reason in the store's manifest instead of failing."""
    packing: bool = False
    """Padding-free batches: each micro-batch is one row of its samples back to back, with position_ids restarting
    at every sample so that attention stays inside it. Same samples and loss as padded batches, no pad tokens."""
    store_dir: str = ""
    """Where the tokenized parquet store lives: a directory every node can read (the driver writes it, each worker
    reads it); empty: `<run.storage_path>/datasets`, which a remote run.storage_path cannot be."""
    prepare: Literal["auto", "local", "ray"] = "auto"
    """Where the store is tokenized: "local" in this process; "ray" in Ray Data tasks on the running Ray, the cluster
    in RAY_ADDRESS, or else a local Ray started for it (data.paths and store_dir must then be readable on every
    node); "auto": Ray for inputs of 64 MiB or more when a cluster is running or in RAY_ADDRESS. Same store."""


@dataclass
class TrainLoopConfig:
    max_steps: int = 300
    """Length of the run: the LR schedule and the data order are laid out for this many optimizer steps."""
    num_epochs: float = 0.0
    """Instead of max_steps (setting both is refused): the run's length in passes over the training data, as TRL's
    num_train_epochs. max_steps becomes num_epochs × (the store's samples // global_batch_size), at least 1: a step
    takes global_batch_size samples whatever the workers and micro-batches. 0: max_steps."""
    stop_at_step: int = 0
    """If set, checkpoint at this step and exit (time-boxed jobs); launching again without it continues."""
    seed: int = 0
    """Seed of the initialization and the data order."""
    global_batch_size: int = 16
    """Samples per optimizer step over all workers; gradient accumulation makes up the difference."""
    micro_batch_size: int = 4
    """Samples per worker per forward/backward (unless micro_batch_tokens is set)."""
    micro_batch_tokens: int = 0
    """With data.packing: cut each worker's share of the global batch into micro-batches of at most this many tokens
    instead of micro_batch_size samples (at least data.max_seq_len). The same samples per optimizer step and the
    same loss normalization, so resuming on any worker count holds; 0: micro_batch_size samples."""
    loss_chunk_tokens: int = 1024
    """The loss runs the LM head and cross-entropy over this many label tokens at a time (recomputed in backward),
    never holding the full fp32 logits; 0: the model's full logits (more memory, same loss)."""
    deterministic: bool = False
    """Deterministic kernels (torch.use_deterministic_algorithms, cuBLAS workspace, no memory-efficient SDPA), so
    that a stopped-and-resumed run is bit-identical on GPUs too; slower there."""
    lr: float = 3e-3
    """Peak learning rate of AdamW, reached after warmup_steps, then cosine decay to min_lr_ratio × lr."""
    min_lr_ratio: float = 0.1
    """Where the cosine decay ends, as a fraction of lr."""
    warmup_steps: int = 20
    """Linear warmup to lr: step s (0-based) runs at (s + 1) / warmup_steps × lr, so the first step already
    learns (the Hugging Face Trainer's step s runs at s / warmup_steps × lr: its first step at 0)."""
    schedule_steps: int = 0
    """Where the cosine decay reaches min_lr_ratio × lr, which the LR then keeps; 0: max_steps. To train a finished
    run further, raise max_steps and set this to the run's old length (docs/RUNS.md, "Train further"): a resume
    whose schedule length changed with max_steps alone is refused, as its LR would jump."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay, on every trained parameter but those of weight_decay_exclude."""
    weight_decay_exclude: list[str] = field(default_factory=lambda: ["bias", "norm"])
    """Parameters not decayed: those whose lowercased name (model.layers.0.input_layernorm.weight) contains a match
    of one of these regular expressions. The default leaves out biases and normalization weights, the Hugging Face
    Trainer's set on LLaMA-style models (embeddings and the LM head are decayed, as there); []: decay every
    parameter."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW's moment decay rates."""
    eps: float = 1e-8
    """AdamW's epsilon, added to the root of the second moment."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (> 0; there is no "off": a huge value never clips)."""
    log_every_n_steps: int = 10
    """Progress lines in the log, and how often the step metrics are reduced over the workers (a device sync);
    metrics.jsonl gets every step, written at these steps, checkpoints and reports."""
    report_every_n_steps: int = 0
    """Metric-only ray.train.report cadence; 0 reports only at checkpoints (each report is a slow barrier)."""
    eval_every_n_steps: int = 0
    """With validation data (data.eval_paths or data.eval_fraction): the eval loss every N steps and at every
    checkpoint; 0: at every checkpoint only."""
    max_skipped_steps: int = 10
    """End the run with TrainingDivergedError, naming the step and what was wrong, after this many skipped steps in
    a row (a step is skipped on every rank, without changing weights, optimizer state or LR schedule, when its loss
    or gradient norm is NaN or inf on any rank, on an fp16 overflow, or on a loss spike); 0: never stop."""
    loss_spike_factor: float = 0.0
    """Skip a step whose loss exceeds this factor times the median loss of the last 32 applied steps (from the 8th
    applied step on; raysft.training.step_guard); 0: off."""
    objective: Literal["sft", "dpo"] = "sft"
    """"sft": next-token cross-entropy on the assistant tokens of conversations. "dpo": direct preference
    optimization on preference pairs (the `dpo` section, docs/DPO.md); global_batch_size and micro_batch_size then
    count pairs, each two sequences."""


# model.attn_implementation: transformers' built-in kernels; anything registered with transformers'
# AttentionInterface (raysft's own included) is accepted too. Extend this tuple for a kernel registered only
# inside the workers.
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention", "flash_attention_2", "varlen")
# varlen: raysft.model.attention


@dataclass
class ParallelConfig:
    sharding: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"] = "FULL_SHARD"
    """PyTorch's FSDP names, all FSDP2 fully_shard on a device mesh (see "Choosing a sharding strategy")."""
    hsdp_shard_size: int = 0
    """HYBRID_SHARD shard-group size; 0 takes workers per node from Ray (wrong when logical nodes share an IP)."""
    mixed_precision: Precision = "fp32"
    """Compute dtype; parameters and optimizer state stay fp32. fp16 turns on dynamic loss scaling."""
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype of the gradient reduce-scatter / all-reduce."""
    fp16_init_scale: float = 2.0**16
    """Initial loss scale for fp16; halved on every overflow (the step is skipped), doubled after 2000 clean steps."""
    activation_checkpointing: str = "none"
    """"none", "full", or an integer k: checkpoint every k-th decoder layer (non-reentrant)."""
    cpu_offload: bool = False
    """Keep parameters, gradients and optimizer state in CPU memory (FSDP2 CPUOffloadPolicy)."""
    compile: bool = False
    """torch.compile each decoder layer (after activation checkpointing, before sharding, as torchtitan does); the
    first steps, and each new shape, pay the compile time."""
    fp8: bool = False
    """FP8 training with torchao's float8 (pip install 'raysft[fp8]'): every linear layer but the LM head whose two
    dimensions are multiples of 16 (the FP8 tensor cores' requirement; torchtitan's filter) computes its matmuls in
    float8 with tensorwise dynamic scaling, and FSDP2 all-gathers those weights in float8. The LM head stays in
    mixed_precision: its logits feed the loss, the step's most precision-sensitive part. Weights, gradients,
    optimizer state and checkpoints keep their names and dtypes. Needs NVIDIA GPUs of compute capability 8.9 or
    higher (refused on CPU and older GPUs) and full fine-tuning (refused with model.lora); fast only with compile,
    which fuses the casts."""
    sequence_parallel: int = 1
    """Ulysses sequence parallelism: each group of N consecutive workers holds 1/N of every packed row's tokens
    and trades it for 1/N of the heads around attention (docs/SEQUENCE_PARALLEL.md); 1: off. Needs data.packing
    and model.attn_implementation varlen; N divides the workers and the model's attention heads."""


@dataclass
class CheckpointConfig:
    mode: Literal["auto", "full", "sharded"] = "auto"
    """"full": HF safetensors, gathered one tensor at a time onto rank 0, which writes them (with async, the whole
    state first); a resume from shared storage reads each rank's slices. "sharded": every worker writes its own
    shards (torch.distributed.checkpoint). "auto": full while the weights and AdamW state (12 bytes per parameter)
    are at most 16 GiB, which rank 0 writes alone, and, with async, fit 4 times into rank 0's available host
    memory; else sharded (one worker: full at any size). Any mode resumes on any worker count and sharding
    strategy."""
    every_n_steps: int = 100
    """Checkpoint every N steps, and at the end."""
    async_save: bool = field(default=False, metadata={"key": "async"})
    """YAML key `async`: stage the state in memory and write it in the background while training goes on; the
    checkpoint is reported to Ray once every rank's part is durable."""
    keep: int = 2
    """Checkpoints kept by Ray (num_to_keep); the latest is never deleted."""
    keep_best: int = 0
    """Instead of `keep`: the N best checkpoints by best_metric plus the latest; Ray's checkpoint_score_attribute.
    A checkpoint without the metric (not validated, or its generation evaluation failed) ranks last. `raysft export
    RUN_DIR OUT --checkpoint best` exports the best."""
    best_metric: str = "eval_loss"
    """What keep_best and `raysft export RUN_DIR OUT --checkpoint best` rank by (export: the run's latest launch's
    value, unless --metric): eval_loss (needs data.eval_paths or data.eval_fraction), another validation metric
    of that pass (eval/rewards/accuracies, eval/rewards/margins with train.objective dpo), or a generation score
    gen/<scorer> of the `eval` section (one of eval.scorers)."""
    best_mode: Literal["auto", "min", "max"] = "auto"
    """Whether a lower or a higher best_metric is better; auto: min for a name ending in "loss", else max."""
    memory_every_n_steps: int = 0
    """The memory tier (0: off): a snapshot of the whole training state in node-local host memory every N steps
    (passed over while the previous one is still being written), each rank's part copied to another node, so that a
    dead worker, node or job group resumes from the newest snapshot instead of the last stored checkpoint. Costs
    host memory per node, in the node's share of the weights and optimizer state: 1x staged, 2x for its newest 2
    snapshots and, with no replica on another node (FULL_SHARD, SHARD_GRAD_OP), 2x for its partner's; `raysft plan
    --host-mem-gib G` counts it and says whether it fits (docs/MEMORY.md)."""
    memory_dir: str = ""
    """Where each node keeps the memory tier's snapshots: node-local shared memory, which outlives the workers
    (empty: /dev/shm/raysft-<uid>, this user's own). Used only if this user owns it and no other user may write it
    or, without the sticky bit, its parent; else the tier stays off, named in the log. What the tier creates there
    is this user's alone (directories 0700, files 0600)."""
    memory_copy_mb_per_s: float = 0.0
    """The rate at which each rank sends its snapshot to its partner on another node (0: as fast as it goes)."""
    memory_timeout_s: float = 300.0
    """The longest the memory tier waits for another rank (a copy's chunk, an agreement): a partner that never
    answers turns the tier off, named in the log, and the run goes on with the stored checkpoints."""


@dataclass
class ScalingConfig:
    num_workers: int = 2
    """Ray Train workers, one per GPU (or a share of the CPUs)."""
    use_gpu: bool = False
    """One GPU per worker and NCCL; otherwise CPU workers and gloo."""
    cpus_per_worker: float = 1.0
    """Logical CPUs per worker; a local Ray is sized from this, so 4 workers fit on a 2-core laptop."""
    min_workers: int = 0
    """Elastic training: start, or go on after losing a node, with as few as this many workers (Ray resizes the
    group between min_workers and num_workers as capacity comes and goes); 0: exactly num_workers."""
    resize_interval_s: float = 60.0
    """Elastic training: how often Ray looks for room to grow a running group back towards num_workers (Ray's
    elastic_resize_monitor_interval_s). Growing restarts the group: with the memory tier it costs at most a step."""
    placement_timeout_s: float = 600.0
    """How long, in all, Ray may wait for the cluster to have room for the workers (at the start, or for
    capacity to come back after a node is lost) before the run fails; a cluster too small to ever hold them fails
    at once."""
    max_failures: int = 3
    """Restarts after a worker or node dies, each from the latest complete checkpoint (-1: unlimited). Preemptions
    announced by Ray do not count; a config error or a failed checkpoint write ends the run at once."""


@dataclass
class RunConfig:
    name: str = "raysft-demo"
    """Fixed run name: launching again with the same name and storage resumes from its latest checkpoint."""
    storage_path: str = "~/raysft_runs"
    """A local or shared (NFS) directory, or a URI of any pyarrow filesystem: s3://bucket/prefix, gs://... Every
    node must reach it; checkpoints, metrics.jsonl and the run's small files live in <storage_path>/<name>."""
    stop_grace_s: float = 30.0
    """On SIGTERM (a scheduler, Kubernetes, `ray job stop`) the workers checkpoint the step they are at and the
    process exits with code 143 within this many seconds, checkpoint or not. Give the sender at least as long."""


TruncationMode = Literal["keep_start", "keep_end", "skip", "error"]


@dataclass
class DpoConfig:
    beta: float = 0.1
    """The strength of the pull towards the reference model (TRL's beta): the implicit reward of an answer is beta
    times its log-probability ratio to the reference's."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """"sigmoid": DPO's -log σ(beta · margin); "ipo": IPO's (margin per answer token - 1 / (2 beta))², the
    log-ratios averaged over each answer's tokens as TRL does."""
    sft_weight: float = 0.0
    """Adds this weight times the mean NLL of the chosen answers' tokens to the loss (RPO; TRL's loss_type
    ["sigmoid", "sft"] with loss_weights [1, w]); 0: off."""
    truncation_mode: TruncationMode = "keep_start"
    """A pair with a sequence longer than data.max_seq_len (TRL's truncation_mode, each sequence cut on its own):
    "keep_start" cuts its end, "keep_end" its start (the prompt's beginning first), "skip" drops the pair, "error"
    refuses it as a bad record (answer_truncated). A prompt that alone leaves no room for an answer token is
    prompt_too_long: dropped by keep_start and skip, refused by error. Dropped pairs are counted per reason in the
    store's manifest whatever data.on_bad_record says; cut sequences under counts.truncated."""
    disable_dropout: bool = True
    """Turn off the policy's dropout (TRL's disable_dropout): every dropout layer, model.lora.dropout's included, and
    the attention's attention_dropout. With dropout the policy's log-probabilities are noisy while the reference's
    are not (the pass runs in eval mode), so the rewards and the loss are noise; false keeps the dropout."""


TRACKERS = ("tensorboard", "mlflow", "wandb")


@dataclass
class MetricsConfig:
    trackers: list[str] = field(default_factory=list)
    """Experiment trackers fed by rank 0 beside metrics.jsonl: any of TRACKERS (each its optional extra, e.g.
    `pip install 'raysft[mlflow]'`). TensorBoard writes <run>/tensorboard; W&B honours WANDB_MODE (offline...)."""
    project: str = "raysft"
    """The MLflow experiment and the W&B project; the tracker run is named run.name."""
    mlflow_tracking_uri: str = ""
    """MLflow server or store URI; empty: MLFLOW_TRACKING_URI, else sqlite:///<run>/mlflow.db (a local run)."""


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    eval: GenEvalConfig = field(default_factory=GenEvalConfig)
    live: LiveConfig = field(default_factory=LiveConfig)

    @property
    def run_dir(self) -> Path | Location:
        """`<run.storage_path>/<run.name>`: a Path on local or NFS storage (as ever), a Location on s3://, gs://..."""
        return native(location(self.run.storage_path) / self.run.name)

    @property
    def store_dir(self) -> Path:
        """A filesystem path: the store is read with plain file I/O (validate refuses URIs here)."""
        base = self.data.store_dir or str(Path(self.run.storage_path) / "datasets")
        return Path(base).expanduser().resolve()

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)


def reference_markdown() -> str:
    """The configuration reference in docs/CONFIGURATION.md, made from these dataclasses: every key, its default and
    its docstring (tests/test_config.py checks that the file holds the current one: regenerate it with
    `python -c 'from raysft.config import reference_markdown as r; print(r())'`)."""
    import ast
    import inspect
    import sys

    docs = {}
    own_modules = (sys.modules[c.__module__] for c in (GenEvalConfig, LiveConfig))  # sections of their own
    modules = (sys.modules[__name__], *own_modules)
    for node in (n for m in modules for n in ast.walk(ast.parse(inspect.getsource(m)))):
        if isinstance(node, ast.ClassDef):
            for stmt, after in zip(node.body, node.body[1:], strict=False):
                if isinstance(stmt, ast.AnnAssign) and isinstance(after, ast.Expr) and \
                        isinstance(after.value, ast.Constant):
                    docs[node.name, stmt.target.id] = " ".join(after.value.value.split())
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    hints = typing.get_type_hints(TrainConfig)
    sections = [(s.name, hints[s.name]) for s in dataclasses.fields(TrainConfig)]
    while sections:
        prefix, cls = sections.pop(0)
        defaults, field_hints = cls(), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(field_hints[f.name]):  # a nested section (model.lora): its keys after
                sections.insert(0, (f"{prefix}.{f.name}", field_hints[f.name]))
                continue
            meaning = docs.get((cls.__name__, f.name), "").replace("|", "\\|")
            if typing.get_origin(field_hints[f.name]) is Literal:
                meaning = f"one of {', '.join(f'`{v}`' for v in typing.get_args(field_hints[f.name]))}. {meaning}"
            rows.append(f"| `{prefix}.{field_key(f)}` | `{getattr(defaults, f.name)!r}` | {meaning.strip()} |")
    return "\n".join(rows)


def field_key(f: dataclasses.Field) -> str:
    """The config key of a field: its name, unless that is a Python keyword (`async`)."""
    return f.metadata.get("key", f.name)


def _to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {field_key(f): _to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    return list(obj) if isinstance(obj, list) else obj
