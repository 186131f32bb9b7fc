"""What each results folder claims: the papers' statements it tests, our verdict on each, how
the setting deviates from the paper's, and which tables its README shows.

A verdict's label (reproduced / partly / contradicted / untested) is a judgement written here;
its numbers are read from the folders' results.json when the README is built
(experiments/results_pages.py), so they cannot drift from the data. Where a rule decides the
label (PaTH's error is exactly 0, an encoding reaches 90% with fewer layers), the label follows
the data too. Paper numbers are quoted from the papers' tables.
"""
from __future__ import annotations

from experiments.claims import convert
from experiments.claims import language as lm
from experiments.claims import probes
from experiments.claims import synthetic as syn
from experiments.claims import tapa_study
from experiments.claims.base import PAPER_ORDER  # noqa: F401
from experiments.claims.base import Page  # noqa: F401
from experiments.claims.base import Section  # noqa: F401
from experiments.claims.base import Verdict

# Folder (relative to experiments/results) -> its page. A committed folder without an entry
# fails tests/test_results_pages.py: every result states its verdicts and deviations.
PAGES = {
    "flipflop": syn.FLIPFLOP, "flipflop_gpu": syn.FLIPFLOP_GPU,
    "flipflop_gpu/sba": syn.SBA_FLIPFLOP_GPU,
    "length_extrapolation": lm.LENGTH, "length_extrapolation_gpu": lm.LENGTH_GPU,
    "length_extrapolation_gpu/tapa_lr2e-4": tapa_study.TAPA_LR,
    "length_extrapolation_gpu/tapa_stable": tapa_study.TAPA_STABLE,
    "length_extrapolation_gpu/tapa_ps003": tapa_study.TAPA_PS003,
    "length_extrapolation_gpu/tapa_linear_ps003": tapa_study.TAPA_LINEAR_PS003,
    "length_extrapolation_gpu/tapa_norm": tapa_study.TAPA_NORM,
    "length_extrapolation_gpu/tapa_linear_norm": tapa_study.TAPA_LINEAR_NORM,
    "length_extrapolation_gpu/tapa_norm_1800": tapa_study.TAPA_NORM_1800,
    "length_extrapolation_gpu/rope_1800": tapa_study.ROPE_1800,
    "length_extrapolation_gpu/tapa_norm_3000": tapa_study.TAPA_NORM_3000,
    "length_extrapolation_gpu/rope_3000": tapa_study.ROPE_3000,
    "length_extrapolation_gpu/tapa_norm_hd128": tapa_study.TAPA_NORM_HD128,
    "length_extrapolation_gpu/rope_hd128": tapa_study.ROPE_HD128,
    "length_extrapolation_gpu/tapa_norm_recipe": tapa_study.TAPA_NORM_RECIPE,
    "length_extrapolation_gpu/tapa_norm_alpha05": tapa_study.TAPA_NORM_ALPHA05,
    "length_extrapolation_gpu/nope": lm.NOPE_GPU,
    "length_extrapolation_gpu/grape_m": lm.GRAPE_M_LM,
    "length_extrapolation_gpu/acc_rot": lm.ACC_ROT_GPU,
    "mqrar": syn.MQRAR, "mqrar_gpu": syn.MQRAR_GPU,
    "mqrar_gpu/rope_n1_seeds": syn.ROPE_N1_SEEDS, "mqrar_gpu/rope_n1_lr3e-4": syn.ROPE_N1_LR3E4,
    "mqrar_gpu/rope_n1_lr3e-3": syn.ROPE_N1_LR3E3,
    "mqrar_gpu/rope_lr3e-4": syn.ROPE_MQRAR_LR3E4, "mqrar_gpu/sba": syn.SBA_MQRAR_GPU,
    "word_problem": syn.WORD_PROBLEM, "word_problem/generators_words16": syn.WORD_PROBLEM_CPU_GEN,
    "word_problem_gpu": syn.WORD_PROBLEM_GPU, **syn.A5_SUBPAGES,
    "distance_bias": probes.DISTANCE_BIAS, "mixing_window": probes.MIXING_WINDOW,
    "distance_bias_gpu": probes.DISTANCE_BIAS_GPU, "mixing_window_gpu": probes.MIXING_WINDOW_GPU,
    "convert": convert.CONVERT, "convert_gpu": convert.CONVERT_GPU,
}

# Paper claims no folder tests yet: they belong in the index as much as the tested ones.
UNTESTED = (
    Verdict("GRAPE Tables 1-2", "GRAPE-A and GRAPE-AP lead in language modelling (downstream "
            "accuracy)", "untested",
            "no downstream evaluation; GRAPE-M against RoPE is in "
            "length_extrapolation_gpu/grape_m/"),
)

# Claims measured by a benchmark rather than a result folder: (verdict, the page with it).
ELSEWHERE = (
    (Verdict("PaTH Fig. 1", "PaTH's kernel is modestly slower than RoPE's flash attention and "
             "faster than FoX's kernel (B 32, 32 heads x 64, across lengths)", "partly",
             "H200, forward+backward: PaTH / RoPE on cuDNN 3.84x at T 1024, 2.90x at 4096, "
             "2.43x at 8192, 2.19x at 16384 (626 against 286 ms): the slowdown shrinks with "
             "length; PaTH / our FoX kernel 2.53x, 1.59x, 1.25x, 1.11x: slower than our FoX "
             "at every length, by a shrinking margin (the paper's FoX kernel not run)", 0),
     "docs/benchmarks/kernel_lengths.md"),
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
