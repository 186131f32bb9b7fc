"""What each results folder claims: the papers' statements it tests, our verdict on each, how
the setting deviates from the paper's, and which tables its README shows.

A verdict's label (reproduced / partly / contradicted / untested) is a judgement written here;
its numbers are read from the folders' results.json when the README is built
(experiments/results_pages.py), so they cannot drift from the data. Where a rule decides the
label (PaTH's error is exactly 0, an encoding reaches 90% with fewer layers), the label follows
the data too. Paper numbers are quoted from the papers' tables.
"""
from __future__ import annotations

from experiments.claims import language as lm
from experiments.claims import synthetic as syn
from experiments.claims.base import PAPER_ORDER  # noqa: F401
from experiments.claims.base import Page  # noqa: F401
from experiments.claims.base import Section  # noqa: F401
from experiments.claims.base import Verdict

# Folder (relative to experiments/results) -> its page. A committed folder without an entry
# fails tests/test_results_pages.py: every result states its verdicts and deviations.
PAGES = {
    "flipflop": syn.FLIPFLOP, "flipflop_gpu": syn.FLIPFLOP_GPU,
    "length_extrapolation": lm.LENGTH, "length_extrapolation_gpu": lm.LENGTH_GPU,
    "length_extrapolation_gpu/tapa_lr2e-4": lm.TAPA_LR,
    "length_extrapolation_gpu/tapa_stable": lm.TAPA_STABLE,
    "length_extrapolation_gpu/nope": lm.NOPE_GPU,
    "mqrar": syn.MQRAR, "mqrar_gpu": syn.MQRAR_GPU,
    "mqrar_gpu/rope_n1_seeds": syn.ROPE_N1_SEEDS, "mqrar_gpu/rope_n1_lr3e-4": syn.ROPE_N1_LR3E4,
    "mqrar_gpu/rope_n1_lr3e-3": syn.ROPE_N1_LR3E3,
    "word_problem": syn.WORD_PROBLEM, "word_problem/generators_words16": syn.WORD_PROBLEM_CPU_GEN,
    "word_problem_gpu": syn.WORD_PROBLEM_GPU, **syn.A5_SUBPAGES,
    "distance_bias": lm.DISTANCE_BIAS, "mixing_window": lm.MIXING_WINDOW,
    "convert": lm.CONVERT,
}

# Paper claims no folder tests yet: they belong in the index as much as the tested ones.
UNTESTED = (
    Verdict("acc_rot Table 1", "the full table at 128x (65K/512), all six rotation rows and "
            "ALiBi at GPU scale", "untested",
            "the GPU sweep evaluates to 32x and ran only the Q/K/V rotations"),
    Verdict("PaTH Table 1 / Fig. 2", "SBA (stick-breaking attention) as a baseline", "untested",
            "SBA is an encoding here ('sba', in the flip-flop, MQRAR and A5 GPU configs) "
            "but the committed runs predate it"),
    Verdict("PaTH Fig. 1", "PaTH's kernel speed against RoPE and FoX kernels across lengths",
            "untested", "no such plot; kernel timings against FLA and cuDNN are in "
            "docs/benchmarks/path_kernel.md"),
    Verdict("GRAPE Tables 1-2", "GRAPE-M matches RoPE and GRAPE-A/AP lead in language "
            "modelling (downstream accuracy)", "untested",
            "GRAPE-M was not run in language modelling; no downstream evaluation"),
)

INDEX_INTRO = """# Paper claims and what this repository measured

Every result folder below holds `results.json` (the numbers), `summaries.json` (the runs),
`provenance.json` (command, machine and config) and a generated `README.md` with a verdict per
claim, the deviations from the paper, tables and plots; `NOTES.md` there is the hand-written
discussion. This file and those READMEs are generated: `python -m experiments.results_pages`
rebuilds them (verdicts and deviations live in `experiments/claims/`; the numbers
are read from the JSON), and `tests/test_results_pages.py` fails when a README no longer says
what its JSON says. Verdicts: **reproduced**, **partly**, **contradicted**, **untested**; a
verdict resting on one seed says so, and a difference inside one seed's spread is not a
finding.
"""

INDEX_OUTRO = """`docs/benchmarks/` holds the kernel and training-speed measurements (one
table per benchmark of `experiments/benchmarks/`), which are not paper reproductions."""
