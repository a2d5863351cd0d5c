"""The data stage: conversations → token ids with assistant-only labels → a parquet store every run can reuse →
each rank's micro-batches.

Records are ShareGPT/FastChat (`{"conversations": [{"from", "value"}]}`) or OpenAI (`{"messages": [{"role",
"content"}]}`), in JSON arrays, JSON Lines, parquet files or Hugging Face datasets directories, each source sampled
into the store by its weight. Labels come from the chat template. Large inputs are tokenized on Ray into the same
rows.

Modules, by role (the orchestration, prepare, sits above both tokenizing paths; the toolbox below them):
  prepare       the one entry: the store's fingerprint, an identical store reused, else built by one of the paths
  tokenize_ray  the Ray Data path: byte-range chunks of the sources tokenized by tasks (Ray imported only there)
  store         the store's rows (Samples, shared by both paths), manifest, files and readers; what to say when no
                record has anything to learn
  readers       JSON arrays and JSON Lines, one record at a time
  sources       data.paths → sources with their weights, hashes and sizes; parquet / Arrow / HF dataset tables
  labels        assistant-only labels from the rendered chat template, tool calls included
  conversation  records (ShareGPT, OpenAI) → messages
  preference    preference records (TRL's prompt/chosen/rejected, full chosen/rejected conversations) → a pair of
                sequences labelled on their answers (train.objective dpo)
  tokenizer     the tokenizer and chat template, refused if it would run code; its fingerprint
  dataloader    the global data cursor → each rank's micro-batches, padded or packed
  demo          the embedded demo's conversations and byte-level BPE tokenizer (raysft/assets/demo)
"""

from raysft.data.conversation import BadRecord
from raysft.data.labels import IGNORE_INDEX
from raysft.data.prepare import prepare_store
from raysft.data.sources import DataError
from raysft.data.store import StoreInfo, read_store, read_store_manifest, store_files
from raysft.errors import StoreFull

__all__ = ["IGNORE_INDEX", "BadRecord", "DataError", "StoreFull", "StoreInfo", "prepare_store", "read_store_manifest",
           "read_store", "store_files"]
