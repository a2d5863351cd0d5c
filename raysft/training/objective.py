"""The training objective, chosen once from train.objective (as torchtitan's TrainSpec picks the loss): what one
sample of a global batch is in the store, the loss the model computes, one step's forward and backward, whether a
pass of the starting weights comes before the resume, and which validation an eval store gets. The trainer, the
launch and the planner ask it; only the configuration's checks (raysft.config.checks) and the store's format
(raysft.data.store.holds_pairs) read train.objective's name.

  SFT  a sample is a conversation, one row of the store; the loss is the cross-entropy of its assistant tokens
       (raysft.training.sft), validated by the loss over the eval store (raysft.training.evaluation)
  DPO  a sample is a preference pair, two rows (raysft.data.store.PAIR_SCHEMA); the loss is DPO's or IPO's against
       reference log-probabilities that a pass of the starting weights computes once per store
       (raysft.training.preference, reference), validated on held-out pairs (raysft.training.preference_eval)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from raysft.config import TrainConfig
from raysft.data.dataloader import TokenizedDataset
from raysft.data.prepare import prepare_store
from raysft.data.store import ROWS_PER_PAIR, ObjectiveName, Split, StoreInfo, pairs_in
from raysft.distributed.collectives import all_ranks
from raysft.distributed.layout import SequenceShard
from raysft.model.loss import install_chunked_loss
from raysft.model.preference_loss import disable_dropout, install_sequence_nll
from raysft.training.evaluation import Evaluator
from raysft.training.metrics import MetricsLogger
from raysft.training.preference import PreferenceStep
from raysft.training.preference_eval import PreferenceEvaluator
from raysft.training.reference import reference_file, reference_logps
from raysft.training.sft import SFTStep

TrainStep = SFTStep | PreferenceStep
Validation = Evaluator | PreferenceEvaluator


@dataclass(frozen=True)
class Worker:
    """The worker an objective's step and validation run on: its data-parallel and sequence place, the world size
    FSDP averages the gradients over (sequence groups included), its device, the tokenizer's pad id, and the run's
    log (where a reference pass says what it did)."""

    shard: SequenceShard
    world_size: int
    device: torch.device
    pad_id: int
    log: MetricsLogger


class Objective:
    """What every objective answers; SFT and DPO below. Built from the whole configuration (objective_for)."""

    name: ObjectiveName
    sample: str
    """What train.global_batch_size counts, in messages."""
    sequences_per_sample: int
    """The store rows (sequences) one sample is: what a micro-batch of micro_batch_size samples holds."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg

    def samples_in(self, rows: int) -> int:
        """The samples of a store of `rows` rows."""
        raise NotImplementedError

    def identity(self) -> dict:
        """What the run's identity records of the objective (raysft.launch.prelaunch.run_identity)."""
        raise NotImplementedError

    def prepare_store(self, tokenizer: PreTrainedTokenizerBase, split: Split = "train",
                      before_writing: Callable[[str], None] | None = None) -> StoreInfo:
        """The data's tokenized store for this objective (raysft.data.prepare.prepare_store)."""
        raise NotImplementedError

    def prepare_model(self, model: nn.Module) -> None:
        """The objective's loss installed on the model, before its weights are loaded."""
        raise NotImplementedError

    def needs_starting_weights(self, stores: list[Path]) -> bool:
        """Collective: whether the step or the validation of `stores` reads the starting weights before the training
        state is restored, also on a resume (a reference pass)."""
        return False

    def step(self, store: Path, model: nn.Module, worker: Worker) -> TrainStep:
        """Collective: this worker's step over the training store `store`."""
        raise NotImplementedError

    def evaluator(self, store: Path, model: nn.Module, worker: Worker) -> Validation:
        """Collective: this worker's validation over the eval store `store`."""
        raise NotImplementedError


class SFT(Objective):
    name, sample, sequences_per_sample = "sft", "samples", 1

    def samples_in(self, rows: int) -> int:
        return rows

    def identity(self) -> dict:
        return {}  # absent: SFT, as in runs recorded before there was a choice

    def prepare_store(self, tokenizer: PreTrainedTokenizerBase, split: Split = "train",
                      before_writing: Callable[[str], None] | None = None) -> StoreInfo:
        return prepare_store(self.cfg.data, tokenizer, self.cfg.store_dir, split=split, before_writing=before_writing)

    def prepare_model(self, model: nn.Module) -> None:
        if self.cfg.train.loss_chunk_tokens:
            install_chunked_loss(model, self.cfg.train.loss_chunk_tokens)

    def step(self, store: Path, model: nn.Module, worker: Worker) -> SFTStep:
        return SFTStep(self.cfg, TokenizedDataset(store), worker.shard, worker.world_size, worker.device,
                       worker.pad_id)

    def evaluator(self, store: Path, model: nn.Module, worker: Worker) -> Evaluator:
        return Evaluator(store, self.cfg, worker.shard, worker.device, worker.pad_id)


class DPO(Objective):
    """Without LoRA, each store's reference log-probabilities are a file beside it (raysft.training.reference),
    computed by a pass of the starting weights where some rank lacks it; with LoRA the reference is the base with
    the adapters off, computed beside each forward."""

    name, sample, sequences_per_sample = "dpo", "pairs", ROWS_PER_PAIR

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        self.reference_files = not cfg.model.lora.r
        self.references: dict[Path, tuple[Path, bool]] = {}  # store -> its reference file, whether some rank lacks it

    def samples_in(self, rows: int) -> int:
        return pairs_in(rows)

    def identity(self) -> dict:
        return {"train.objective": self.name}

    def prepare_store(self, tokenizer: PreTrainedTokenizerBase, split: Split = "train",
                      before_writing: Callable[[str], None] | None = None) -> StoreInfo:
        return prepare_store(self.cfg.data, tokenizer, self.cfg.store_dir, split=split, objective=self.name,
                             before_writing=before_writing, truncation_mode=self.cfg.dpo.truncation_mode)

    def prepare_model(self, model: nn.Module) -> None:
        install_sequence_nll(model, self.cfg.train.loss_chunk_tokens)
        if self.cfg.dpo.disable_dropout:
            disable_dropout(model)

    def needs_starting_weights(self, stores: list[Path]) -> bool:
        if not self.reference_files:
            return False
        return any([self._reference_file(store)[1] for store in stores])  # every store checked, on every rank

    def step(self, store: Path, model: nn.Module, worker: Worker) -> PreferenceStep:
        dataset = TokenizedDataset(store)
        reference = self._reference(store, dataset, model, worker)
        return PreferenceStep(self.cfg, dataset, reference, worker.shard, worker.world_size, worker.device,
                              worker.pad_id)

    def evaluator(self, store: Path, model: nn.Module, worker: Worker) -> PreferenceEvaluator:
        reference = self._reference(store, TokenizedDataset(store), model, worker)
        return PreferenceEvaluator(store, self.cfg, reference, worker.shard.dp_rank, worker.shard.dp_size,
                                   worker.device, worker.pad_id)

    def _reference_file(self, store: Path) -> tuple[Path, bool]:
        """Collective at a store's first call: its reference file, and whether some rank lacks it."""
        if store not in self.references:
            path = reference_file(store, self.cfg)
            self.references[store] = path, not all_ranks(path.is_file())
        return self.references[store]

    def _reference(self, store: Path, dataset: TokenizedDataset, model: nn.Module,
                   worker: Worker) -> torch.Tensor | None:
        """Collective: the store's reference log-probabilities (None with LoRA: the adapters off). A DPO worker's
        data-parallel place is its rank (no sequence parallelism: raysft.config.checks)."""
        if not self.reference_files:
            return None
        path, missing = self._reference_file(store)
        return reference_logps(path, missing, model, dataset, self.cfg, worker.shard, worker.device,
                               worker.pad_id, worker.log)


OBJECTIVES: dict[str, type[Objective]] = {"sft": SFT, "dpo": DPO}


def objective_for(cfg: TrainConfig) -> Objective:
    """The objective train.objective names (load_config has refused any other)."""
    return OBJECTIVES[cfg.train.objective](cfg)
