"""grain input pipelines: synthetic tasks generated on the fly and the packed code corpus.

Every batch is a dict of numpy arrays of shape [B, T] (B = the batch size this process
yields, T = seq_len):
  tokens       int32    input tokens
  targets      int32    what position t must predict (the next token for language
                        modelling; the running product for word problems)
  loss_mask    float32  1 where the loss and the task metric count
  segment_ids  int32    1, 2, ... for the documents packed in a row, 0 for padding
  positions    int32    position inside the segment, restarting at 0 at its start

Fields of the `data` ConfigDict (`default_data_config()` has them all):
  task                "flipflop" | "word_problem" | "mqrar" | "text"
  seq_len             training row length T (512)
  flipflop:           ignore_prob 0.8 (train and "id"), sparse_ignore_prob 0.98,
                      dense_ignore_prob 0.1; byte_tokens False (True: each symbol is its
                      character's byte, in the text task's 257-token vocabulary)
  word_problem:       group "A5" | "S5"; alphabet "group" | "generators" (optional: absent
                      means "group")
  mqrar:              n_back 1, num_pairs 32 (distinct keys), num_values 32,
                      query_prob 0.3
  text:               text_dir None (the interpreter's stdlib .py files) or a directory,
                      file or glob of text files (tasks/code_corpus.py), max_files None (all),
                      valid_fraction 0.05, shuffle_window 256 (rows shuffled in a
                      window after packing; 0 turns it off); optional (absent = None):
                      tokenizer (a tokenizer.json instead of bytes), doc_token (None: its
                      eos), vocab_size (None: the data's): tasks/code_corpus.py
  synthetic tasks:    read_threads 1, prefetch_batches 16: the host threads that generate
                      the training stream ahead of the step, and how many batches they keep
                      ready (grain.ReadOptions)
The task modules (experiments/tasks/) document each task's exact definition.

Why one read thread: the generators are Python, so they hold the GIL while they work, and
every thread that does takes it in turn from the training loop's dispatch. With grain's default
(16 threads, 500 batches ahead) the flip-flop model's step took 32-47 ms on an H200 host
whose device work was under 2 ms (experiments/benchmarks/step_profile.py); on the 2-core CPU a
trivial put-and-dispatch went from 0.13 to 3.1 ms while the default pool was filling. One
thread generates as fast (the GIL serialises them anyway) without the convoy.

Determinism: synthetic example i of a stream comes from numpy's Generator seeded with
(seed, stream, i), stream 0 for training and 1 + k for the k-th test set, so eval sets
never reuse training examples' randomness. The training iterator is a grain
DatasetIterator whose get_state()/set_state() resume it exactly, also from a state that went
through JSON (as grain's Orbax handler stores it).

Several processes: the global batch of B = batch_size x process_count rows is cut into
process_count blocks of batch_size rows, and the process with process_index p reads block p
of every global batch (rows p x batch_size ... (p + 1) x batch_size - 1). So the processes
together see exactly the batches one process with batch_size B would, and every process's
iterator state is the same (a count of global batches, or the text packer's position), which
lets a checkpoint written by n processes resume under any other number. Synthetic tasks
generate only their own rows; text rows are packed from the whole corpus by every process
(the packing is cheap next to a training step) and each keeps its block.
"""
from __future__ import annotations

import functools

import grain
import ml_collections
import numpy as np
from ml_collections import config_dict

from experiments.tasks import SYNTHETIC, code_corpus

TASKS = tuple(SYNTHETIC) + ("text",)
# Synthetic streams are indexable "forever"; 2**62 examples is never exhausted.
_STREAM_LEN = 2**62


def default_data_config() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict({
      "task": "flipflop",
      "seq_len": 512,
      # flipflop
      "ignore_prob": 0.8,
      "sparse_ignore_prob": 0.98,
      "dense_ignore_prob": 0.1,
      "byte_tokens": False,
      # word_problem
      "group": "A5",
      # mqrar
      "n_back": 1,
      "num_pairs": 32,
      "num_values": 32,
      "query_prob": 0.3,
      # text
      "text_dir": config_dict.placeholder(str),
      "max_files": config_dict.placeholder(int),
      "valid_fraction": 0.05,
      "shuffle_window": 256,
      # synthetic tasks' training stream
      "read_threads": 1,
      "prefetch_batches": 16,
  })


def _check(config, seq_len: int | None = None) -> None:
  """Raises one ValueError naming the offending data.* field."""
  if config.task not in TASKS:
    raise ValueError(f"data.task={config.task!r} must be one of {TASKS}")
  name = "data.seq_len" if seq_len is None else "seq_len"  # the field, or an eval length
  seq_len = config.seq_len if seq_len is None else seq_len
  minimum = SYNTHETIC[config.task].MIN_SEQ_LEN if config.task in SYNTHETIC else 1
  if not isinstance(seq_len, (int, np.integer)) or seq_len < minimum:
    raise ValueError(f"{name}={seq_len!r} must be an int >= {minimum} "
                     f"for data.task={config.task!r}")
  for field in ("read_threads", "prefetch_batches"):
    value = config[field]
    if not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"data.{field}={value!r} must be an int >= 1")
  code_corpus.check_tokenizer(config)
  if config.task in SYNTHETIC:
    SYNTHETIC[config.task].validate(config)
  else:
    if config.shuffle_window < 0:
      raise ValueError(f"data.shuffle_window={config.shuffle_window} must be >= 0")
    code_corpus.split_files(config, "valid")  # checks text_dir, valid_fraction, max_files


def vocab_size(config) -> int:
  _check(config)
  if config.task == "text":
    return code_corpus.vocab_size(config)
  return SYNTHETIC[config.task].vocab_size(config)


def max_seq_len(config) -> int | None:
  """The longest row the data can fill, or None when unbounded.

  Synthetic tasks generate any length. Text rows are packed from the held-out
  validation files, so a row longer than their total token count could never be full.
  """
  _check(config)
  if config.task == "text":
    return code_corpus.split_files(config, "valid")[2]
  return None


def eval_set_names(config) -> tuple[str, ...]:
  _check(config)
  return ("valid",) if config.task == "text" else SYNTHETIC[config.task].TEST_SETS


def _check_batching(batch_size: int, process_index: int = 0, process_count: int = 1) -> None:
  if batch_size < 1:
    raise ValueError(f"batch_size={batch_size} must be >= 1")
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} must lie in "
                     f"[0, process_count={process_count})")


# --- synthetic tasks ---------------------------------------------------------------


class _SyntheticExample:
  """index -> example of one stream; a plain picklable callable (for multiprocess prefetch)."""

  def __init__(self, config, *, split: str, seq_len: int, seed: int):
    task = SYNTHETIC[config.task]
    self.task_name, self.split, self.seq_len, self.seed = config.task, split, seq_len, seed
    self.stream = 0 if split == "train" else 1 + task.TEST_SETS.index(split)
    self.config = ml_collections.FrozenConfigDict(config)  # a snapshot, immune to later edits

  def __call__(self, index: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([self.seed, self.stream, index])
    ex = SYNTHETIC[self.task_name].make_example(self.config, rng, seq_len=self.seq_len,
                                                split=self.split)
    ex["segment_ids"] = np.ones(self.seq_len, np.int32)
    ex["positions"] = np.arange(self.seq_len, dtype=np.int32)
    return ex


def _synthetic_rows(config, *, split: str, seq_len: int, seed: int) -> grain.MapDataset:
  """Example i of the `split` stream, as a MapDataset over the (practically) infinite range."""
  example = _SyntheticExample(config, split=split, seq_len=seq_len, seed=seed)
  return grain.MapDataset.range(_STREAM_LEN).map(example)


def _block_index(i: int, *, rows: int, index: int, count: int) -> int:
  """The stream index of this process's i-th example: row i % rows of its block `index` in
  global batch i // rows (global batches hold `count` blocks of `rows` rows)."""
  return (i // rows) * rows * count + index * rows + i % rows


def _take_block(batch: dict[str, np.ndarray], *, rows: int, index: int) -> dict[str, np.ndarray]:
  return {k: v[index * rows:(index + 1) * rows] for k, v in batch.items()}


# --- text --------------------------------------------------------------------------


def _packed_text(config, split: str, *, seq_len: int, seed: int) -> grain.IterDataset:
  """Documents packed into rows of seq_len (long ones split), unbatched."""
  root, files, _ = code_corpus.split_files(config, split)
  docs = grain.MapDataset.source(files)
  if split == "train":
    docs = docs.shuffle(seed).repeat()  # reshuffled every epoch
  docs = docs.map(code_corpus.DocumentReader(config, root))
  rows = grain.experimental.ConcatThenSplitIterDataset(
      docs.to_iter_dataset(), length_struct={"inputs": seq_len, "targets": seq_len})
  return rows.map(_text_row)


def _text_row(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  segment_ids = row["inputs_segment_ids"].astype(np.int32)
  return {
      "tokens": row["inputs"].astype(np.int32),
      "targets": row["targets"].astype(np.int32),
      "loss_mask": (segment_ids > 0).astype(np.float32),
      "segment_ids": segment_ids,
      "positions": row["inputs_positions"].astype(np.int32),
  }


def _empty_row(seq_len: int) -> dict[str, np.ndarray]:
  zeros = np.zeros(seq_len, np.int32)
  return {"tokens": zeros, "targets": zeros, "loss_mask": np.zeros(seq_len, np.float32),
          "segment_ids": zeros, "positions": zeros}


def _stack(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


# --- resumable iterator -------------------------------------------------------------


class _JsonStateIterator(grain.DatasetIterator):
  """The pipeline's iterator, restorable from its state after a JSON round trip.

  grain's Orbax handler writes get_state() as JSON, which turns the tuples of the text
  packer's state (ConcatThenSplit's `remainder_slices`, (-1, -1) for "no remainder") into
  lists. The packer tests its sentinel with `!=`, so a restored [-1, -1] reads as a
  remainder: it pulls one document too many and every later row shifts. That state is
  saved for every position inside the first shuffle window (the window restarts from its
  start state, taken before any document was read), so a run stopped there resumed onto
  other data. set_state turns those lists back into tuples before grain sees them.
  """

  def __init__(self, parent: grain.DatasetIterator):
    super().__init__(parent)

  def __next__(self):
    return next(self._parent)

  def get_state(self):
    return self._parent.get_state()

  def set_state(self, state) -> None:
    self._parent.set_state(_slices_as_tuples(state))


def _slices_as_tuples(state):
  if isinstance(state, dict):
    return {k: ({f: tuple(s) for f, s in v.items()} if k == "remainder_slices"
                else _slices_as_tuples(v)) for k, v in state.items()}
  if isinstance(state, list):
    return [_slices_as_tuples(v) for v in state]
  return state


# --- the contract ------------------------------------------------------------------


def make_train_iter(config, *, batch_size: int, seed: int, process_index: int = 0,
                    process_count: int = 1) -> grain.DatasetIterator:
  """The training stream as a checkpointable grain iterator of [batch_size, seq_len] batches."""
  _check(config)
  _check_batching(batch_size, process_index, process_count)
  if config.task == "text":
    rows = _packed_text(config, "train", seq_len=config.seq_len, seed=seed)
    if config.shuffle_window > 1:
      rows = grain.experimental.WindowShuffleIterDataset(rows, window_size=config.shuffle_window,
                                                         seed=seed)
    batches = rows.batch(batch_size * process_count, drop_remainder=True, batch_fn=_stack)
    if process_count > 1:
      batches = batches.map(functools.partial(_take_block, rows=batch_size, index=process_index))
    return _JsonStateIterator(iter(batches))
  indices = grain.MapDataset.range(_STREAM_LEN)
  if process_count > 1:
    indices = indices.map(functools.partial(_block_index, rows=batch_size, index=process_index,
                                            count=process_count))
  rows = indices.map(_SyntheticExample(config, split="train", seq_len=config.seq_len, seed=seed))
  read = grain.ReadOptions(num_threads=config.read_threads,
                           prefetch_buffer_size=config.prefetch_batches)
  return _JsonStateIterator(
      iter(rows.batch(batch_size, drop_remainder=True, batch_fn=_stack).to_iter_dataset(read)))


def make_eval_sets(config, *, seq_len: int, batch_size: int, num_batches: int,
                   seed: int, process_index: int = 0,
                   process_count: int = 1) -> dict[str, list[dict[str, np.ndarray]]]:
  """name -> list of batches at `seq_len`; the same arguments give the same batches.

  Synthetic tasks: each test set has exactly num_batches batches. Text: "valid" holds
  the held-out files packed in sorted order (seed unused), up to num_batches batches;
  the last batch is filled with all-padding rows (loss_mask 0) if the files run out.
  batch_size is per process: block process_index of global batches of
  batch_size x process_count rows, as in make_train_iter.
  """
  _check(config, seq_len)
  _check_batching(batch_size, process_index, process_count)
  if num_batches < 1:
    raise ValueError(f"num_batches={num_batches} must be >= 1")
  whole = batch_size * process_count
  if config.task == "text":
    rows = _packed_text(config, "valid", seq_len=seq_len, seed=seed)
    batches, it = [], iter(rows)
    for _ in range(num_batches):
      chunk = [row for _, row in zip(range(whole), it)]
      if not chunk:
        break
      chunk += [_empty_row(seq_len)] * (whole - len(chunk))
      batches.append(_take_block(_stack(chunk), rows=batch_size, index=process_index))
    return {"valid": batches}
  sets = {}
  first = process_index * batch_size
  for name in SYNTHETIC[config.task].TEST_SETS:
    rows = _synthetic_rows(config, split=name, seq_len=seq_len, seed=seed)
    sets[name] = [_stack([rows[b * whole + first + i] for i in range(batch_size)])
                  for b in range(num_batches)]
  return sets
