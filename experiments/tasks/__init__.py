"""Synthetic tasks and the code corpus.

Each synthetic task module provides `vocab_size(config)`, `validate(config)`,
`TEST_SETS` (the names of its test sets), `MIN_SEQ_LEN` and
`make_example(config, rng, *, seq_len, split)` -> {"tokens", "targets", "loss_mask"}
(numpy [T] arrays) for split "train" or one of TEST_SETS. `config` is the `data`
ConfigDict of experiments/data.py.
"""
from __future__ import annotations

from experiments.tasks import code_corpus, flipflop, mqrar, word_problem

SYNTHETIC = {"flipflop": flipflop, "word_problem": word_problem, "mqrar": mqrar}
