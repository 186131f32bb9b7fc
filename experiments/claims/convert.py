"""Verdicts and deviations of converting a RoPE model into PaTH by distillation (PaTH §4.3)."""
from __future__ import annotations

from experiments.claims.base import Page
from experiments.claims.base import Verdict
from experiments.claims.base import seeds


def _convert_claims(load) -> list[Verdict]:
  r = load.results()
  runs, L, L4 = r["runs"], str(r["lengths"][0]), str(r["lengths"][1])
  mean = {n: sum(runs[n]["loss"][L]) / len(runs[n]["loss"][L]) for n in runs}
  cell = {n: seeds(runs[n]["loss"][L], ".4f") for n in runs}
  at4 = {n: seeds(runs[n]["loss"][L4], ".4f") for n in runs}
  conv, scratch, teacher = mean["path_converted"], mean["rope_scratch"], mean["teacher"]
  # Per seed: does the early conversion beat the late one (same seed's teacher)?
  early_wins = sum(e < c for e, c in zip(runs["path_converted_early"]["loss"][L],
                                         runs["path_converted"]["loss"][L]))
  n = r.get("seeds", 1)
  tokens = f"{runs['path_converted']['tokens']:,}"
  return [
      Verdict("PaTH §4.3", "a pretrained RoPE model converted into PaTH by two-stage "
              "distillation (attention-output MSE, then output KL) and trained on does as well "
              "as its RoPE teacher or better (Tables 4-5: the student within a few points of "
              "the teacher, and ahead of RoPE after continued pretraining)",
              # Both halves: near the teacher it came from, and ahead of RoPE trained on.
              "reproduced" if conv <= scratch else "partly"
              if conv <= 1.02 * scratch or conv <= 1.02 * teacher else "contradicted",
              f"held-out loss at the training length, all at {tokens} tokens: converted PaTH "
              f"{cell['path_converted']}, the teacher trained on (rope_scratch) "
              f"{cell['rope_scratch']}, PaTH from scratch {cell['path_scratch']}; the teacher "
              f"itself {cell['teacher']} at {runs['teacher']['tokens']:,}. At {L4} tokens (4x) "
              f"the converted PaTH extrapolates as PaTH does: {at4['path_converted']} against "
              f"RoPE's {at4['rope_scratch']} (PaTH from scratch {at4['path_scratch']})", n),
      Verdict("PaTH §4.3", "conversion may work better before the teacher 'ossifies' "
              "(the paper's remark after distilling an overtrained model)",
              "reproduced" if early_wins == n else "partly" if early_wins else "contradicted",
              f"at equal total tokens, converting the teacher's halfway checkpoint gives "
              f"{cell['path_converted_early']} at the training length and "
              f"{at4['path_converted_early']} at 4x, its final checkpoint "
              f"{cell['path_converted']} and {at4['path_converted']}; the early one is lower "
              f"in {early_wins} of {n} seeds", n)]


def _deviations(scale: str, probe_steps: int) -> tuple[str, ...]:
  return (
      scale,
      "Stage 2 is also the continued training: no separate continued-pretraining phase.",
      "Evaluation: held-out loss at 1x, 4x and 8x the training length, and a flip-flop probe "
      f"(each model fine-tuned on flip-flop in byte tokens from its parameters, {probe_steps} "
      "steps), instead of the paper's benchmarks (MMLU, GSM-8K, HumanEval, RULER, ...).",
      "'The teacher trained on' (rope_scratch) is a fresh RoPE run of the teacher's config for "
      "the total tokens, not the teacher's checkpoint continued: its learning-rate schedule "
      "spans the whole run.",
      "Ossification: the early teacher is the same run's halfway checkpoint, not an "
      "overtrained model; its conversion's stage 2 is longer by the teacher's second half, so "
      "both conversions end at equal total tokens.")


CONVERT = Page(
    "Converting RoPE into PaTH by distillation (PaTH §4.3)", _convert_claims,
    _deviations("Scale: a 2-layer d_model 64 llama-style RoPE teacher trained on 512,000 "
                "byte-level tokens of Python source at length 64 on a CPU; the paper converts "
                "SmolLM2-1.7B and Qwen2.5-7B-Instruct with 100M (stage 1) and 3B (stage 2) "
                "tokens of DCLM, then 21B tokens of continued pretraining. "
                "configs/convert.py:gpu holds the 12-layer GPU version (convert_gpu/).", 100))

CONVERT_GPU = Page(
    "Converting RoPE into PaTH by distillation on one GPU (PaTH §4.3)", _convert_claims,
    _deviations("Scale: a 12-layer d_model 768 llama-style RoPE teacher (~125M parameters, "
                "bfloat16) trained on 39.3M byte-level tokens of Python source at length 2048 "
                "on one H200; stage 1 on 1.6M tokens, stage 2 on 9.8M (the early conversion "
                "on 29.5M). The paper converts SmolLM2-1.7B and Qwen2.5-7B-Instruct with 100M "
                "(stage 1) and 3B (stage 2) tokens of DCLM, then 21B tokens of continued "
                "pretraining.", 300)
    + ("One seed of the whole experiment (teacher, three conversions, two scratch runs, six "
       "probes) takes about 25 GPU-minutes.",))
