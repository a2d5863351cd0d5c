"""The tokenized store: parquet files of token ids and assistant-only labels, and the manifest that says how they
were made. `Samples` turns records into rows and counts what was skipped; the local and the Ray path both build
through it, so the two stores agree. The store is content-addressed (raysft.data.prepare computes the key), so a
changed input makes a new store and an existing one is never rewritten in place."""

from __future__ import annotations

import errno
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from transformers import PreTrainedTokenizerBase

from raysft.config import DataConfig, DpoConfig
from raysft.config.sections import TruncationMode
from raysft.data.conversation import BadRecord, to_conversation
from raysft.data.labels import IGNORE_INDEX, Labelled, label_conversation, marks_generation, template_profile
from raysft.data.preference import SkippedPair, label_pair, to_pair
from raysft.data.sources import DataError, Source, copies

STORE_FORMAT = 2  # 2: labels from the one rendering of the whole conversation (raysft.data.labels), tool calls
# Token bytes per parquet row group: a worker reading one sample decodes its whole row group, so a group is kept
# small enough that decoding it is cheap next to a step.
ROW_GROUP_BYTES = 256 << 10


Split = Literal["train", "eval"]
ObjectiveName = Literal["sft", "dpo"]
# A preference store (train.objective dpo): each pair is two consecutive rows, 2k its chosen sequence and 2k + 1 its
# rejected one, both of the same source record; a bool column `chosen` says which is which.
PAIR_SCHEMA = "rows 2k (chosen) and 2k+1 (rejected) of pair k"
ROWS_PER_PAIR = 2


def holds_pairs(objective: ObjectiveName) -> bool:
    """Whether a store made for `objective` holds preference pairs (PAIR_SCHEMA) rather than a row per sample: the
    data's one reading of the objective's name (the training side asks raysft.training.objective)."""
    return objective == "dpo"


def pairs_in(rows: int) -> int:
    """The pairs of a preference store of `rows` rows (PAIR_SCHEMA)."""
    return rows // ROWS_PER_PAIR


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # no space left, or the user's quota reached


@dataclass
class StoreInfo:
    path: Path
    num_samples: int
    reused: bool
    built_with: str = ""
    """"local" or "ray" when this call wrote the store (the store is the same either way)."""


def appended_stop(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The end-of-turn token raysft supervises after a last assistant turn that the template leaves open."""
    if marks_generation(tokenizer) or not tokenizer.chat_template:
        return None
    profile = template_profile(tokenizer)
    return profile.closes_turn if profile.open_last_turn else None


def labelling(tokenizer: PreTrainedTokenizerBase, cfg: DataConfig) -> dict:
    """How the store's labels were found, for the manifest: a reader can tell what was supervised and why."""
    if marks_generation(tokenizer):
        return {"method": "generation_blocks", "train_on": cfg.train_on}
    profile = template_profile(tokenizer)
    return {"method": "rendered_spans", "train_on": cfg.train_on, "end_of_turn": sorted(profile.end_of_turn),
            "tool_calls": profile.call_prefix is not None, "stop_after_last_turn": appended_stop(tokenizer),
            "rewritten_turns": "assistant turns whose text the template renders otherwise (earlier turns' reasoning "
                               "dropped, say) are labelled as rendered and counted in counts.rewritten_turns"}


def read_store_manifest(store: Path) -> dict:
    return json.loads((store / "manifest.json").read_text())


def store_files(store: Path) -> list[Path]:
    """The store's parquet files in sample order: samples.parquet, or one samples-<chunk>.parquet per chunk that
    had samples when Ray built it."""
    single = store / "samples.parquet"
    if single.is_file():
        return [single]
    return sorted(store.glob("samples-*.parquet"), key=lambda p: int(p.stem.partition("-")[2]))


def read_store(store: Path, columns: list[str] | None = None) -> pa.Table:
    """The whole store as one table, for tests and tools; training reads it lazily (dataloader.TokenizedDataset)."""
    return pa.concat_tables([pq.read_table(p, columns=columns) for p in store_files(store)])


class Samples:
    """Tokenized records, in input order, and the counts the manifest keeps. The local path feeds it every record,
    a Ray task one chunk's: the same code on both sides is what makes the two stores agree."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, objective: ObjectiveName = "sft",
                 truncation_mode: TruncationMode = DpoConfig.truncation_mode):
        """objective "dpo": each record is a preference pair (raysft.data.preference), two rows: see PAIR_SCHEMA;
        one longer than cfg.max_seq_len is what truncation_mode (dpo.truncation_mode) says."""
        self.tokenizer, self.cfg, self.pairs = tokenizer, cfg, holds_pairs(objective)
        self.truncation_mode = truncation_mode
        self.columns: dict[str, list] = {"input_ids": [], "labels": [], "num_loss_tokens": [], "source": [],
                                         "record": []}
        if self.pairs:
            self.columns["chosen"] = []
        self.skipped: Counter[str] = Counter()
        self.records = self.truncated = self.rewritten_turns = self.weighted_out = self.held_out = 0

    def add(self, source: str, index: int, record: Any, copies: int | None = 1) -> None:
        """One record, appended `copies` times (its source's weight); one not sampled at all is counted only, as is
        one of the other split (None: see split_copies)."""
        self.records += 1
        if copies is None:
            self.held_out += 1
            return
        if not copies:
            self.weighted_out += 1
            return
        try:
            rows = self._label(record)
            # a label at position 0 is never predicted: count what the shifted loss actually sees
            loss_tokens = [sum(1 for t in row.labels[1:] if t != IGNORE_INDEX) for row in rows]
            if 0 in loss_tokens:
                raise BadRecord("no_assistant_tokens_after_truncation",
                                f"no assistant token is left within data.max_seq_len={self.cfg.max_seq_len}")
        except BadRecord as e:
            if self.cfg.on_bad_record == "error" and not isinstance(e, SkippedPair):
                raise DataError(f"{source}: record {index}: {e} "
                                "(set data.on_bad_record=skip to skip such records)") from None
            self.skipped[e.reason] += 1
            return
        self.truncated += sum(len(row.input_ids) == self.cfg.max_seq_len for row in rows)
        self.rewritten_turns += sum(row.rewritten_turns for row in rows)
        for _ in range(copies):  # a pair's two rows stay next to each other
            for k, (row, num_loss_tokens) in enumerate(zip(rows, loss_tokens, strict=True)):
                values = (row.input_ids, row.labels, num_loss_tokens, source, index)
                for name, value in zip(self.columns, values, strict=False):
                    self.columns[name].append(value)
                if self.pairs:
                    self.columns["chosen"].append(k == 0)

    def _label(self, record: Any) -> list[Labelled]:
        """The record's rows: one conversation, or a preference pair's chosen and rejected sequence."""
        if self.pairs:
            return list(label_pair(self.tokenizer, to_pair(record, self.cfg.system_prompt), self.cfg.max_seq_len,
                                   self.truncation_mode))
        return [label_conversation(self.tokenizer, to_conversation(record, self.cfg.system_prompt),
                                   self.cfg.max_seq_len, self.cfg.train_on)]

    def counts(self) -> dict:
        return {"records": self.records, "samples": len(self.columns["record"]), "truncated": self.truncated,
                "rewritten_turns": self.rewritten_turns, "weighted_out": self.weighted_out,
                "held_out": self.held_out, "skipped": dict(self.skipped),
                **({"pairs": pairs_in(len(self.columns["record"]))} if self.pairs else {})}

    def write(self, path: Path) -> None:
        c = self.columns
        write_samples(pa.table({
            "input_ids": pa.array(c["input_ids"], type=pa.list_(pa.int32())),
            "labels": pa.array(c["labels"], type=pa.list_(pa.int32())),
            "num_loss_tokens": pa.array(c["num_loss_tokens"], type=pa.int32()),
            "num_tokens": pa.array([len(ids) for ids in c["input_ids"]], type=pa.int32()),
            "source": pa.array(c["source"], type=pa.string()),
            "record": pa.array(c["record"], type=pa.int64()),
            **({"chosen": pa.array(c["chosen"], type=pa.bool_())} if "chosen" in c else {}),
        }), path)


def write_samples(table: pa.Table, path: Path) -> None:
    """Row groups of about ROW_GROUP_BYTES of tokens; written aside and renamed, so that a retried Ray task replaces
    a file whole."""
    token_bytes = 8 * (pc.sum(pc.list_value_length(table["input_ids"])).as_py() or 0)  # ids + labels, int32
    part = path.with_name(f".{path.name}.{os.getpid()}")
    pq.write_table(table, part, row_group_size=max(1, table.num_rows * ROW_GROUP_BYTES // max(1, token_bytes)))
    os.replace(part, path)


# What to change when every record was skipped for one reason (data.on_bad_record=skip).
SKIP_HINTS = {"no_assistant_turn": "a record without an assistant turn has nothing to learn",
              "no_assistant_tokens_after_truncation": "raise data.max_seq_len: it keeps the start of each conversation"}


def no_usable_records(sources: list[Source], cfg: DataConfig, counts: dict, split: Split | None = None) -> DataError:
    """No sample at all, so nothing to train on: the files and why, from the counts, to say what to change."""
    why = [f"{counts['records']} records read"]
    if counts["skipped"]:
        why.append("skipped with data.on_bad_record=skip: " + ", ".join(
            f"{n} {reason}" + (f" ({SKIP_HINTS[reason]})" if reason in SKIP_HINTS else "")
            for reason, n in counts["skipped"].items()))
    if counts["weighted_out"]:
        why.append(f"{counts['weighted_out']} left out by a source weight below 1")
    if counts["held_out"]:
        why.append(f"{counts['held_out']} held out for validation (data.eval_fraction={cfg.eval_fraction})")
    where = f" of the {split} split (data.eval_fraction)" if split else ""
    return DataError(f"no record{where} of {', '.join(str(s.path) for s in sources)} has anything to learn: "
                     f"{'; '.join(why)}")


def split_copies(cfg: DataConfig, split: Split, weight: float, source_sha: str, index: int) -> int | None:
    """How many times a record goes into the `split` store; None for a record of the other split. With
    data.eval_fraction, a deterministic share of each source's records (by its content hash and the record's index,
    as weights sample) goes into the eval store once each and never into the train store."""
    if not cfg.eval_fraction:
        return copies(weight, source_sha, index)
    held = copies(cfg.eval_fraction, f"eval:{source_sha}", index) == 1  # a draw of its own, not the weight's
    if split == "eval":
        return 1 if held else None
    return None if held else copies(weight, source_sha, index)


