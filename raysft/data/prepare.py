"""`prepare_store`: the one entry of the data stage. Sources → the store's fingerprint → an identical store reused,
else tokenized here (`_tokenize_here`) or by Ray Data tasks (raysft.data.tokenize_ray) into the same rows and
manifest, built aside and renamed into place (a store is never rewritten in place)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from raysft.config import DataConfig, DpoConfig
from raysft.config.sections import TruncationMode
from raysft.data.readers import read_records
from raysft.data.sources import Source, resolve_sources
from raysft.data.store import (
    DISK_FULL,
    PAIR_SCHEMA,
    STORE_FORMAT,
    ObjectiveName,
    Samples,
    Split,
    StoreInfo,
    appended_stop,
    holds_pairs,
    labelling,
    no_usable_records,
    read_store_manifest,
    split_copies,
)
from raysft.data.tokenize_ray import tokenize_on_ray, use_ray
from raysft.data.tokenizer import tokenizer_fingerprint
from raysft.errors import StoreFull
from raysft.storage import built_then_renamed


def prepare_store(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, store_root: Path,
                  split: Split = "train", objective: ObjectiveName = "sft",
                  before_writing: Callable[[str], None] | None = None,
                  truncation_mode: TruncationMode = DpoConfig.truncation_mode) -> StoreInfo:
    """Tokenize cfg.paths into `<store_root>/<fingerprint>` unless an identical store is already there.

    `objective` "dpo" reads preference records into pairs of rows (raysft.data.preference, store.PAIR_SCHEMA),
    fitted into cfg.max_seq_len as `truncation_mode` (dpo.truncation_mode) says; both are part of the fingerprint,
    so an SFT and a DPO store of the same files never mix. Preference stores are tokenized here, never on Ray.
    `before_writing(fingerprint)` runs before a new store is tokenized: a launch refuses there what it would refuse
    anyway (another run's data), before anything is written.

    `split` "eval" is the validation store: cfg.eval_paths, or the records data.eval_fraction holds out of cfg.paths
    (then the "train" store lacks them). Where (data.prepare) is not part of the fingerprint: both ways write the
    same rows and manifest.
    """
    if split == "eval" and cfg.eval_paths:  # a store like any other, of those files
        cfg = dataclasses.replace(cfg, paths=cfg.eval_paths, eval_paths=[])
        split = "train"
    sources = resolve_sources(cfg)
    source_info = [s.info() for s in sources]
    key = {
        "format": STORE_FORMAT,
        "sources": [[s.sha256, s.weight] if s.weight != 1 else s.sha256 for s in sources],
        "system_prompt": cfg.system_prompt,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "max_seq_len": cfg.max_seq_len,
        "on_bad_record": cfg.on_bad_record,
        "train_on": cfg.train_on,
        **({"eval_split": [cfg.eval_fraction, split]} if cfg.eval_fraction else {}),
        **({"stop_after_last_turn": stop} if (stop := appended_stop(tokenizer)) else {}),
        **({"objective": objective, "pairs": PAIR_SCHEMA, "truncation_mode": truncation_mode}
           if holds_pairs(objective) else {}),
    }
    fingerprint = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    store = store_root / fingerprint
    manifest_path = store / "manifest.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("fingerprint") == fingerprint:
            return StoreInfo(store, manifest["counts"]["samples"], reused=True)
    if before_writing is not None:
        before_writing(fingerprint)

    on_ray = not holds_pairs(objective) and use_ray(cfg.prepare, sum(s.bytes for s in sources))
    # A directory without a manifest under the store's name is debris of a crash before the rename: replaced.
    try:
        with built_then_renamed(store, replace=lambda existing: not manifest_path.is_file(),
                                reclaim=True) as tmp:
            if on_ray:
                counts = tokenize_on_ray(cfg, tokenizer, sources, tmp, split)
            else:
                counts = _tokenize_here(cfg, tokenizer, sources, tmp, split, objective, truncation_mode)
            manifest = {
                "fingerprint": fingerprint,
                "key": key,
                "sources": source_info,
                "tokenizer": {"name_or_path": str(tokenizer.name_or_path), "sha256": key["tokenizer"]},
                "chat_template": tokenizer.chat_template,
                "labels": labelling(tokenizer, cfg),
                "counts": counts,
            }
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    except OSError as e:
        if manifest_path.is_file():  # another process finished the same store first: theirs is identical
            return StoreInfo(store, read_store_manifest(store)["counts"]["samples"], reused=True)
        if e.errno in DISK_FULL:  # what was written of the store went with its build directory
            raise StoreFull(f"data.store_dir: {store_root} is full ({os.strerror(e.errno)}) while the store "
                            f"{store.name} was written; its partial files were removed and nothing else there was "
                            "touched. Free space there or set data.store_dir to another disk, and launch again: the "
                            "store is then tokenized whole") from None
        raise
    return StoreInfo(store, counts["samples"], reused=False, built_with="ray" if on_ray else "local")


def _tokenize_here(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, sources: list[Source], out: Path,
                   split: Split = "train", objective: ObjectiveName = "sft",
                   truncation_mode: TruncationMode = DpoConfig.truncation_mode) -> dict:
    samples = Samples(tokenizer, cfg, objective, truncation_mode)
    for source in sources:
        for index, record in read_records(source.path):
            samples.add(str(source.path), index, record, split_copies(cfg, split, source.weight, source.sha256, index))
    counts = samples.counts()
    if not counts["samples"]:
        raise no_usable_records(sources, cfg, counts, split if cfg.eval_fraction else None)
    samples.write(out / "samples.parquet")
    return counts
