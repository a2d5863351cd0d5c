"""`raysft` command line: a thin layer over the Python API (raysft.train, export, chat, report, plan).

Each command imports what it needs when it runs: `--help`, a config error and `raysft report` come without torch and
transformers (seconds of imports), and only `train` needs Ray (through `raysft.train`), so that `export`, `chat`,
`report`, `plan` and `prepare` run where Ray is not installed (an inference box, a laptop)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
from collections.abc import Callable
from typing import get_args

from raysft.config import SCORERS, ConfigError, Precision, TrainConfig, best_mode, load_config
from raysft.distributed.layout import ParallelDims, check_hsdp_shard_size_fits_nodes, node_sizes, spread_evenly
from raysft.launch.paths import resolve_paths
from raysft.launch.signals import EXIT_SIGINT, Stopped, exit_process, stop_message
from raysft.storage import location
from raysft.tools.known import KNOWN
from raysft.training import METRICS_FILE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raysft", description="Distributed SFT of LLaMA-style models on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_config_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("config", nargs="?", help="YAML config (default: the embedded demo)")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one config value (repeatable); VALUE is parsed as YAML")

    p_train = sub.add_parser("train", help="train on the Ray cluster in RAY_ADDRESS, or on a local Ray")
    add_config_args(p_train)
    p_train.add_argument("--fresh", action="store_true",
                         help="start the run over instead of resuming it: the whole old run is set aside (its "
                              "directory kept, renamed; its memory-tier snapshots reclaimed)")
    p_train.add_argument("--export", metavar="DIR", help="export the final checkpoint to DIR as an HF model")
    p_train.add_argument("--prompt", help="with --export: print the exported model's answer to PROMPT")
    p_train.add_argument("--force", action="store_true",
                         help="with --export: replace DIR even if it holds something other than an earlier export")
    p_prepare = sub.add_parser("prepare", help="tokenize the data into the parquet store ahead of training")
    add_config_args(p_prepare)
    p_export = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory")
    p_export.add_argument("checkpoint_dir", help="a checkpoint, or a run directory (see --checkpoint)")
    p_export.add_argument("out_dir")
    p_export.add_argument("--checkpoint", default="latest", metavar="latest|best|STEP",
                          help="in a run directory: the newest checkpoint, the best by the run's "
                               "checkpoint.best_metric (or --metric), or a step")
    p_export.add_argument("--metric", metavar="NAME", help="with --checkpoint best: rank by NAME (eval_loss, "
                          "gen/<scorer>, eval/rewards/accuracies, ...) instead of the run's checkpoint.best_metric; "
                          "lower is better for a name ending in loss, else higher")
    p_export.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    p_export.add_argument("--dtype", choices=get_args(Precision), default="fp32",
                          help="the exported weights' dtype (training keeps fp32; bf16 halves the export)")
    p_export.add_argument("--merge", action="store_true",
                          help="LoRA checkpoint: a full model with the adapters merged in (default: a peft adapter "
                               "directory)")
    p_export.add_argument("--max-shard-mb", type=int,
                          help="largest safetensors shard; more weights than this are split with an index "
                               "(default: 5120, as transformers' save_pretrained)")
    p_chat = sub.add_parser("chat", help="talk to an exported model or a checkpoint, with its training chat template")
    p_chat.add_argument("model_dir", help="HF model directory, or a raysft checkpoint (<run>/checkpoint_<step>)")
    p_chat.add_argument("--prompt", help="print the answer to PROMPT and exit (default: a REPL on stdin)")
    p_chat.add_argument("--system", help="system message opening the conversation")
    p_chat.add_argument("--max-new-tokens", type=int, help="the longest answer, in tokens (default: 128)")
    p_plan = sub.add_parser("plan", help="print the memory a run needs per worker and per host, and whether it fits "
                                         "(starts nothing)")
    p_plan.add_argument("--host-mem-gib", type=_positive(float), help="host memory of one node, for the memory tier's "
                                                            "(checkpoint.memory_every_n_steps) count")
    add_config_args(p_plan)
    p_plan.add_argument("--model", metavar="NAME|CONFIG", help="the architecture to count: one of "
                        f"{', '.join(KNOWN)}, a config.json or a model directory (default: model.config, or "
                        "model.path's config.json); no weights and no tokenizer are read")
    p_plan.add_argument("--workers", type=_positive(int), help="workers: the same as --set scaling.num_workers=N, "
                                                               "checked as a launch checks it")
    p_plan.add_argument("--nodes", type=_positive(int), help="nodes the workers are spread on (default: the "
                        "cluster's GPU nodes, else workers / parallel.hsdp_shard_size, else 1)")
    p_plan.add_argument("--gpu-mem-gib", type=_positive(float), help="memory of one GPU (default: read from the "
                                                                      "Ray cluster in RAY_ADDRESS when there is one)")
    p_plan.add_argument("--tokens", type=_positive(int), help="tokens of the largest micro-batch (default: "
                                                               "train.micro_batch_tokens, else micro_batch_size x "
                                                               "max_seq_len)")
    p_eval = sub.add_parser("eval", help="generate answers to an eval set with a model or checkpoint, score them, and "
                                         "print the scores and where the per-sample table went (docs/EVAL.md)")
    p_eval.add_argument("model", help="HF model directory or export, a raysft checkpoint (full, sharded or LoRA), "
                                      "or a run directory (--checkpoint)")
    p_eval.add_argument("eval_set", help="JSONL of prompts with their expected answers (builtin:demo-eval: the demo's)")
    p_eval.add_argument("--checkpoint", default="latest", metavar="latest|best|STEP",
                        help="in a run directory: which checkpoint (best: by --config's checkpoint.best_metric, "
                             "else the run's)")
    p_eval.add_argument("--config", help="a run's YAML: its eval section and data.system_prompt (the flags below "
                                         "override them)")
    p_eval.add_argument("--scorers", help=f"comma-separated, of {', '.join(SCORERS)} (default: eval.scorers)")
    p_eval.add_argument("--answer-pattern", help="the regex scorer's regular expression")
    p_eval.add_argument("--max-new-tokens", type=_positive(int))
    p_eval.add_argument("--temperature", type=float, help="0: greedy (the default), as raysft chat")
    p_eval.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p_eval.add_argument("--max-samples", type=_positive(int), help="only the first N records")
    p_eval.add_argument("--engine", choices=("auto", "hf", "vllm"))
    p_eval.add_argument("--out", metavar="DIR", help="where samples.jsonl and result.json go (default: a checkpoint's "
                                                     "eval/ directory, else ./eval-<model directory's name>)")
    p_report = sub.add_parser("report", help=f"plot a run's loss and tokens/s from its {METRICS_FILE}")
    p_report.add_argument("run_dir")
    p_report.add_argument("--out", metavar="FILE.png", help="where to write the plot (default: RUN_DIR/report.png)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "train" and args.prompt and not args.export:
        parser.error("--prompt needs --export DIR")
    if args.command == "train" and args.force and not args.export:
        parser.error("--force needs --export DIR")
    if args.command == "export" and args.max_shard_mb is not None and args.max_shard_mb <= 0:
        parser.error(f"--max-shard-mb must be at least 1, got {args.max_shard_mb}")
    if args.command == "export" and args.metric and args.checkpoint != "best":
        parser.error("--metric needs --checkpoint best")

    try:
        if args.command == "export":
            return _export(args)
        if args.command == "chat":
            return _chat(args.model_dir, args.prompt, args.system, args.max_new_tokens)
        if args.command == "report":
            return _report(args.run_dir, args.out)
        if args.command == "eval":
            return _eval(args)
        # a relative path in the config means what it means here, where the command was typed (raysft.launch.paths)
        if args.command == "plan":  # --workers N is scaling.num_workers=N: every check of a launch applies to it
            workers = [f"scaling.num_workers={args.workers}"] if args.workers else []
            return _plan(resolve_paths(load_config(args.config, [*args.overrides, *workers])), args.model,
                         args.nodes, args.gpu_mem_gib, args.tokens, args.host_mem_gib)
        config = resolve_paths(load_config(args.config, args.overrides))
        if args.command == "prepare":
            return _prepare(config)
        return _train(config, args.fresh, args.export, args.prompt, args.force)
    except ConfigError as e:
        print(f"raysft: config error: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        result = e.result
        checkpoint = result.checkpoint.path if e.checkpointed and result and result.checkpoint else None
        print(stop_message(e.signum, config.run_dir, checkpoint, str(e)), file=sys.stderr)
        _end_stopped(e.exit_code)
    except KeyboardInterrupt:  # Ctrl-C outside training (tokenizing, exporting): nothing half-written is kept
        print(stop_message(signal.SIGINT, None, None).splitlines()[0], file=sys.stderr)
        _end_stopped(EXIT_SIGINT)
    except Exception as e:  # noqa: BLE001 - the CLI's contract is a message and a non-zero exit
        print(f"raysft: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _end_stopped(code: int) -> None:
    """A stopped `raysft train` ends here: the local Ray it started goes down with all its processes (the call
    that waited on Ray Train may still be inside Ray's client, so the process does not finalize: see exit_process).
    Ray is in sys.modules only if this command used it (train; prepare on a cluster)."""
    ray = sys.modules.get("ray")
    if ray is not None:
        ray.shutdown()
    exit_process(code)


def _export(args: argparse.Namespace) -> int:
    from raysft.checkpoint.retention import run_best, select_checkpoint
    from raysft.products.export import DEFAULT_SHARD_BYTES, export

    best = run_best(args.checkpoint_dir, args.metric)
    ckpt = select_checkpoint(args.checkpoint_dir, args.checkpoint, best)
    if args.checkpoint == "best":
        print(f"raysft: the best checkpoint by {best[0]} ({'lowest' if best[1] == 'min' else 'highest'}): {ckpt}")
    shard_bytes = DEFAULT_SHARD_BYTES if args.max_shard_mb is None else args.max_shard_mb * 2**20
    out = export(ckpt, args.out_dir, overwrite=args.force, max_shard_bytes=shard_bytes, dtype=args.dtype,
                 merge=args.merge)
    print(f"raysft: exported {ckpt} to {out}")
    return 0


def _prepare(config: TrainConfig) -> int:
    from raysft.data import read_store_manifest, store_files
    from raysft.data.tokenizer import load_tokenizer
    from raysft.training.objective import objective_for

    store = objective_for(config).prepare_store(load_tokenizer(config.model, config.data.chat_template))
    counts = read_store_manifest(store.path)["counts"]
    print(f"raysft: data store {store.path} ({'reused' if store.reused else 'written'}): {counts}")
    if store.built_with == "ray":
        print(f"raysft: tokenized by Ray Data tasks into {len(store_files(store.path))} parquet files")
    return 0


def _train(config: TrainConfig, fresh: bool, export_dir: str | None, prompt: str | None, force: bool = False) -> int:
    import raysft
    from raysft.products.export import check_export_target, export
    from raysft.tools.chat import generate_answer
    from raysft.training.gen_log import gen_scores, score_line
    from raysft.training.metrics import ProgressBar

    overwrite = True if force else "export"  # an earlier export of `raysft train --export` is replaced
    if export_dir:
        check_export_target(export_dir, overwrite, location(config.run_dir))  # before training, not after it
    interactive = sys.stderr.isatty()  # a bar with ETA on a terminal; logs get the workers' plain lines
    with ProgressBar(config.run_dir, config.train.max_steps) if interactive else contextlib.nullcontext():
        result = raysft.train(config, fresh=fresh)
    if result.checkpoint is None:
        raise RuntimeError(f"run {config.run.name} finished without a checkpoint in {config.run_dir}")
    print(f"raysft: run directory {result.path}\nraysft: latest checkpoint {result.checkpoint.path}")
    if config.eval.path:
        print(f"raysft: {score_line(gen_scores(config.run_dir), config.eval.path)}")
    if export_dir:
        with result.checkpoint.as_directory() as ckpt:
            out = export(ckpt, export_dir, overwrite=overwrite)
        print(f"raysft: exported {out}")
        if prompt:
            print(f"user: {prompt}\nassistant: {generate_answer(out, prompt)}")
    return 0


def _positive(kind: type) -> Callable[[str], int | float]:
    """An argparse type: a finite number of `kind` above 0 (float() takes "nan" and "inf", which no plan can use)."""
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text!r}")
        return value
    return parse


def _plan(config: TrainConfig, model: str | None, nodes: int | None, gpu_mem_gib: float | None,
          tokens: int | None, host_mem_gib: float | None = None) -> int:
    """`raysft plan`: the architecture from --model or the config (no weights, no tokenizer), every check a launch
    makes that needs no files or data (raysft.launch.prelaunch.check_architecture besides load_config's), and the
    cluster in RAY_ADDRESS, if any, probed as `raysft train` probes it before anything waits on it."""
    from raysft.launch.prelaunch import check_architecture
    from raysft.tools.architectures import initial_weights_fallback, plan_architecture
    from raysft.tools.plan import GPU_MEMORY_GB, GiB, Topology, model_shape, plan, render

    hf_config, source = plan_architecture(config, model)
    check_architecture(config, hf_config)
    workers = config.scaling.num_workers
    if nodes is not None and nodes > workers:
        raise ConfigError(f"--nodes {nodes}: more nodes than the {workers} workers (scaling.num_workers) to spread "
                          "on them")
    shape = model_shape(config, hf_config)
    cluster = _cluster_gpus() if os.environ.get("RAY_ADDRESS") and (gpu_mem_gib is None or nodes is None) else None
    if cluster:
        print(f"raysft: cluster in RAY_ADDRESS: {cluster[1]} GPU node(s) of {cluster[0] or 'unknown'} GPUs")
    gpu_bytes = gpu_mem_gib * GiB if gpu_mem_gib else None
    if gpu_bytes is None and cluster and cluster[0] in GPU_MEMORY_GB:
        gpu_bytes = GPU_MEMORY_GB[cluster[0]] * 1e9
    if nodes is None:
        nodes = cluster[1] if cluster and cluster[1] else ParallelDims.nodes_for(config.parallel, workers)
    check_hsdp_shard_size_fits_nodes(config.parallel, workers, node_sizes(spread_evenly(workers, nodes)))
    print(f"raysft: architecture from {source}")
    rank0_init = initial_weights_fallback(config, hf_config)
    host_bytes = host_mem_gib * GiB if host_mem_gib else None
    result = plan(config, shape, Topology(workers, nodes, gpu_bytes, host_bytes), tokens, rank0_init)
    print(render(config, result))
    return 0


def _cluster_gpus() -> tuple[str | None, int]:
    """(accelerator type, number of GPU nodes) of the running cluster in RAY_ADDRESS; it is only read, once
    something answers at its address (ClusterUnreachable, naming it, after the connect timeout: ray.init alone
    retries a dead address for minutes). Ray is imported here, not at the top: `raysft plan` without a cluster runs
    where Ray is not installed."""
    import ray

    from raysft.distributed.local_ray import check_reachable

    check_reachable()
    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
    try:
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive") and n["Resources"].get("GPU")]
    finally:
        ray.shutdown()
    kinds = {k.removeprefix("accelerator_type:") for r in nodes for k in r if k.startswith("accelerator_type:")}
    return (kinds.pop() if len(kinds) == 1 else None), len(nodes)


def _chat(model_dir: str, prompt: str | None, system: str | None, max_new_tokens: int | None) -> int:
    import transformers

    from raysft.products.chat_model import DEFAULT_MAX_NEW_TOKENS, ChatModel
    from raysft.tools.chat import Conversation, repl

    transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bar before the first prompt
    conversation = Conversation(ChatModel.load(model_dir), system, max_new_tokens or DEFAULT_MAX_NEW_TOKENS)
    if prompt is not None:
        print(conversation.ask(prompt))
    else:
        repl(conversation)
    return 0


def _eval(args: argparse.Namespace) -> int:
    """`raysft eval`: the run's generation evaluation outside a run (raysft.evals.runner.evaluate_model)."""
    import transformers

    from raysft.checkpoint import CHECKPOINT_PREFIX
    from raysft.checkpoint.retention import run_best, select_checkpoint
    from raysft.evals.runner import evaluate_model, run_settings, summary
    from raysft.products.directories import is_checkpoint

    # each flag's value as JSON, which YAML reads as it is: a flag is never parsed as YAML ("answer: (\w+)" would be
    # a mapping), as a --set value is
    flags = {"path": args.eval_set, "answer_pattern": args.answer_pattern, "max_new_tokens": args.max_new_tokens,
             "temperature": args.temperature, "max_samples": args.max_samples, "engine": args.engine,
             "scorers": [s.strip() for s in args.scorers.split(",")] if args.scorers else None, "stop": args.stop}
    sets = [f"eval.{key}={json.dumps(value)}" for key, value in flags.items() if value is not None]
    recorded = None if args.config else run_settings(args.model, args.eval_set)
    if recorded:  # a run's checkpoint, evaluated as its run did unless --config or a flag says otherwise
        print(f"raysft: the run's own settings for {args.eval_set} (its newest evaluation record)")
        sets = [*recorded, *sets]
    config = resolve_paths(load_config(args.config, sets))
    transformers.utils.logging.disable_progress_bar()
    # --config's ranking, else the one the run recorded at its latest launch
    best = (config.checkpoint.best_metric, best_mode(config.checkpoint)) if args.config else run_best(args.model)
    where = location(args.model)
    run_or_checkpoint = is_checkpoint(where) or (where.is_dir() and bool(where.dirs(CHECKPOINT_PREFIX)))
    model = select_checkpoint(args.model, args.checkpoint, best) if run_or_checkpoint else args.model
    record, table, note = evaluate_model(model, config.eval, config.data.system_prompt, args.out)
    if note:
        print(f"raysft: {note}")
    print(f"raysft: {model}: {summary(record)}\nraysft: per-sample table {table}")
    return 0


def _report(run_dir: str, out: str | None) -> int:
    from raysft.tools.report import draw, read_curves

    curves = read_curves(run_dir)
    png = draw(curves, out or curves.path.parent / "report.png")
    print(f"raysft: report {png}\nraysft: {curves.summary()}")
    if curves.unreadable_lines:
        print(f"raysft: skipped {curves.unreadable_lines} unreadable lines of {curves.path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
