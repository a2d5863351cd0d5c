"""`raysft` command line: a thin layer over the Python API (raysft.train, raysft.export)."""

from __future__ import annotations

import argparse
import sys

from raysft.chat import generate_answer
from raysft.config import ConfigError, TrainConfig, load_config
from raysft.data import prepare_store, read_manifest
from raysft.hf_export import DEFAULT_SHARD_BYTES, export
from raysft.launch import train
from raysft.tokenizer import load_tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raysft", description="Distributed SFT of LLaMA-style models on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_config_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("config", nargs="?", help="YAML config (default: the embedded demo)")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one config value (repeatable); VALUE is parsed as YAML")

    p_train = sub.add_parser("train", help="train on the Ray cluster in RAY_ADDRESS, or on a local Ray")
    add_config_args(p_train)
    p_train.add_argument("--fresh", action="store_true",
                         help="start the run over instead of resuming it (the old run directory is kept, renamed)")
    p_train.add_argument("--export", metavar="DIR", help="export the final checkpoint to DIR as an HF model")
    p_train.add_argument("--prompt", help="with --export: print the exported model's answer to PROMPT")
    p_prepare = sub.add_parser("prepare", help="tokenize the data into the parquet store ahead of training")
    add_config_args(p_prepare)
    p_export = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory")
    p_export.add_argument("checkpoint_dir")
    p_export.add_argument("out_dir")
    p_export.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    p_export.add_argument("--max-shard-mb", type=int, default=DEFAULT_SHARD_BYTES // 2**20,
                          help="largest safetensors shard; more weights than this are split with an index")
    args = parser.parse_args(argv)
    if getattr(args, "prompt", None) and not args.export:
        parser.error("--prompt needs --export DIR")

    try:
        if args.command == "export":
            out = export(args.checkpoint_dir, args.out_dir, overwrite=args.force,
                         max_shard_bytes=args.max_shard_mb * 2**20)
            print(f"raysft: exported {out}")
            return 0
        config = load_config(args.config, args.overrides)
        if args.command == "prepare":
            return _prepare(config)
        return _train(config, args.fresh, args.export, args.prompt)
    except ConfigError as e:
        print(f"raysft: config error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - the CLI's contract is a message and a non-zero exit
        print(f"raysft: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _prepare(config: TrainConfig) -> int:
    store = prepare_store(config.data, load_tokenizer(config.model, config.data.chat_template), config.store_dir)
    counts = read_manifest(store.path)["counts"]
    print(f"raysft: data store {store.path} ({'reused' if store.reused else 'written'}): {counts}")
    return 0


def _train(config: TrainConfig, fresh: bool, export_dir: str | None, prompt: str | None) -> int:
    result = train(config, fresh=fresh)
    if result.checkpoint is None:
        raise RuntimeError(f"run {config.run.name} finished without a checkpoint in {config.run_dir}")
    print(f"raysft: run directory {result.path}\nraysft: latest checkpoint {result.checkpoint.path}")
    if export_dir:
        with result.checkpoint.as_directory() as ckpt:
            out = export(ckpt, export_dir, overwrite=True)
        print(f"raysft: exported {out}")
        if prompt:
            print(f"user: {prompt}\nassistant: {generate_answer(out, prompt)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
