"""Rows of experiments/benchmarks/train_throughput.py: the JSON-lines file, the names a row can
carry, and the tables made from it (the end-of-run table and the markdown of --markdown).

A row is one (encoding, T) measurement as a dict; KEY_FIELDS identify it, so a later run skips
what the file already holds and the last row written for a key wins.
"""
from __future__ import annotations

import json
import os

from posenc_jax import encodings

ANCHORS = ("fla_path", "fla_path_fox")
KV_SHIFT = "+kv_shift"  # "rope+kv_shift": ModelConfig(encoding="rope", kv_shift=True)
MATMUL = "matmul_bf16"  # the measured-peak row
# scan_layers: absent (None) in rows from before the flag, which all ran the unrolled loop.
KEY_FIELDS = ("encoding", "seq_len", "batch", "dtype", "implementation", "scan_layers", "embed")


def runnable_encodings() -> list[str]:
  """Every encoding the model can run alone, plus rope with the kv_shift modifier."""
  return [n for n in encodings.NAMES if n not in encodings.MODIFIERS] + ["rope" + KV_SHIFT]


def row_key(row: dict) -> tuple:
  return tuple(row.get(k) for k in KEY_FIELDS)


def read_rows(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def append_row(path: str, row: dict) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "a") as f:
    f.write(json.dumps(row) + "\n")


def _yes_no(x) -> str:
  return "n/a" if x is None else ("yes" if x else "NO")


def _fmt(x, spec: str, missing: str = "-") -> str:
  return missing if x is None else format(x, spec)


def progress_line(row: dict) -> str:
  if row["encoding"] == MATMUL:
    return (f"{MATMUL} {row['seq_len']}^3: {_fmt(row.get('measured_tflops'), '.4g')} TFLOP/s "
            f"{row.get('error') or ''}")
  head = f"{row['encoding']:>22} T={row['seq_len']:<5} B={row['batch']:<3}"
  if row.get("error"):
    return f"{head} ERROR {row['error'][:200]}"
  return (f"{head} {row['tokens_per_s']:>9,.0f} tok/s {row['step_ms']:8.1f} ms "
          f"MFU {_fmt(row['mfu'], '.1%')} ({_fmt(row.get('mfu_measured'), '.1%')} of measured) "
          f"peak {_fmt(row['peak_gib'], '.1f')} GiB loss {row['loss_first']:.3f}->"
          f"{row['loss_last']:.3f} compile {row['compile_s']:.0f} s {row['attention_impl']} "
          f"P={row['params']:,}")


def latest_rows(rows: list[dict]) -> dict:
  """key -> the last row written for it (a re-run after --force or --retry-errors wins)."""
  return {row_key(r): r for r in rows}


def label(row: dict) -> str:
  """Row name in tables: the encoding, plus what differs from the default measurement."""
  return row["encoding"] + _extras(row["implementation"] if row["implementation"] not in (
      "auto", "fla") else None, row["dtype"] if row["dtype"] != "bfloat16" else None,
      "scan" if row.get("scan_layers") else None)


def _extras(*extra) -> str:
  extra = [x for x in extra if x]
  return f" [{', '.join(extra)}]" if extra else ""


def _ratio_to_rope(row: dict, by_label_t: dict) -> float | None:
  """tokens/s over RoPE-on-cuDNN's at the same T and layer loop ("rope [cudnn]" or
  "rope [cudnn, scan]"), else over rope's with the same bracketed label."""
  scan = "scan" if row.get("scan_layers") else None
  cudnn = "rope" + _extras("cudnn", scan)
  rope = (by_label_t.get((cudnn, row["seq_len"])) if row["dtype"] == "bfloat16"
          else None) or by_label_t.get(("rope" + label(row)[len(row["encoding"]):],
                                        row["seq_len"]))
  if row.get("error") or not rope or rope.get("error"):
    return None
  return row["tokens_per_s"] / rope["tokens_per_s"]


def _order_key(name: str) -> tuple:
  """Tables list encodings in NAMES order, the anchors last."""
  known = runnable_encodings() + list(ANCHORS)
  base = name.split(" [")[0]
  return (known.index(base) if base in known else len(known), name)


def render_markdown(rows: list[dict], *, command: str | None = None) -> str:
  """One table row per encoding (columns per T), with the header facts."""
  latest = [r for r in latest_rows(rows).values() if r["encoding"] != MATMUL]
  peaks = [r for r in latest_rows(rows).values() if r["encoding"] == MATMUL and not r["error"]]
  seq_lens = sorted({r["seq_len"] for r in latest})
  by_label_t = {(label(r), r["seq_len"]): r for r in latest}
  devices = sorted({r["device_kind"] for r in latest + peaks if r.get("device_kind")})
  jaxes = sorted({r["jax_version"] for r in latest + peaks if r.get("jax_version")})
  torches = sorted({r["torch_version"] for r in latest if r.get("torch_version")})
  dates = sorted(r["date"] for r in latest + peaks)
  commands = sorted({r["command"] for r in latest + peaks if r.get("command")})
  rope_impl = sorted({f"{r['attention_impl']} at T={r['seq_len']}" for r in latest
                      if r["encoding"] == "rope" and not r.get("error")})
  batch = sorted({f"B={r['batch']} at T={r['seq_len']}" for r in latest})
  given_peak = sorted({f"{r['peak_tflops']:.0f}" for r in latest if r.get("peak_tflops")})
  measured = [f"{r['measured_tflops']:.4g} TFLOP/s at {r['seq_len']}^3" for r in peaks]
  params = sorted({f"{r['encoding']}: {r['params']:,}" for r in latest if r.get("params")
                   and r["encoding"] in ("rope", "path", "fla_path")})
  lines = ["# Training-step throughput per encoding", "",
           f"- command: {command or '; '.join(f'`{c}`' for c in commands) or '-'}",
           f"- machine: {', '.join(devices) or '-'}; jax {', '.join(jaxes) or '-'}"
           + (f"; torch {', '.join(torches)}" if torches else ""),
           f"- date: {dates[0] if dates else '-'} .. {dates[-1] if dates else '-'}",
           f"- batch: {', '.join(batch)} (constant tokens per step); dtype and implementation "
           f"in brackets where not bfloat16 / auto",
           f"- parameters (incl. the untied head): {'; '.join(params) or '-'}",
           f"- ratio = tokens/s over `rope [cudnn]`'s (RoPE on cuDNN, segments as a dense "
           f"mask) at the same T where measured, else over `rope`'s; rope's attention ran as: "
           f"{', '.join(rope_impl) or '-'}",
           "- MFU: model FLOPs (formula in experiments/benchmarks/train_throughput.py) / step "
           f"time / peak; first against --peak-tflops ({', '.join(given_peak) or '-'} TFLOP/s), "
           f"in parentheses against the measured bf16 matmul peak "
           f"({', '.join(measured) or 'not measured'})",
           "- loss: first -> last of the loss steps; finite / falling (last 5 mean < first 5)",
           ""]
  cols = ["encoding", "attention"]
  for t in seq_lens:
    cols += [f"tok/s T={t}", f"ratio T={t}"]
  cols += ["MFU " + " / ".join(str(t) for t in seq_lens), "peak GiB", "loss first→last",
           "finite, falling", "compile s", "error"]
  lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for name in sorted({label(r) for r in latest}, key=_order_key):
    per_t = [by_label_t.get((name, t)) for t in seq_lens]
    ok = [r for r in per_t if r and not r.get("error")]
    cells = [name, " / ".join(sorted({r["attention_impl"] for r in ok})) or "-"]
    for r in per_t:
      good = r is not None and not r.get("error")
      cells += [f"{r['tokens_per_s']:,.0f}" if good else "-",
                _fmt(_ratio_to_rope(r, by_label_t), ".2f") if good else "-"]
    both = lambda f: " / ".join(f(r) if r and not r.get("error") else "-" for r in per_t)
    cells += [both(lambda r: f"{_fmt(r['mfu'], '.1%')} ({_fmt(r.get('mfu_measured'), '.1%')})"),
              both(lambda r: _fmt(r["peak_gib"], ".1f")),
              both(lambda r: f"{r['loss_first']:.2f}→{r['loss_last']:.2f}"),
              both(lambda r: f"{'yes' if r['loss_finite'] else 'NO'}, "
                             f"{_yes_no(r['loss_falling'])}"),
              both(lambda r: f"{r['compile_s']:.0f}"),
              "; ".join(f"T={r['seq_len']}: {r['error'][:120]}" for r in per_t
                        if r and r.get("error")).replace("|", "/")]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def print_table(rows: list[dict]) -> None:
  """A compact end-of-run table (the device machine returns only the output's tail)."""
  latest = [r for r in latest_rows(rows).values() if r["encoding"] != MATMUL]
  for r in latest_rows(rows).values():
    if r["encoding"] == MATMUL:
      print(progress_line(r), flush=True)
  print(f"{'encoding':>24} {'T':>5} {'tok/s':>9} {'xrope':>6} {'MFU':>6} {'GiB':>5} "
        f"{'loss':>13} {'cmp s':>5}  attention / error", flush=True)
  by_label_t = {(label(r), r["seq_len"]): r for r in latest}
  for r in sorted(latest, key=lambda r: (r["seq_len"], _order_key(label(r)))):
    if r.get("error"):
      print(f"{label(r):>24} {r['seq_len']:>5} ERROR {r['error'][:90]}", flush=True)
      continue
    print(f"{label(r):>24} {r['seq_len']:>5} {r['tokens_per_s']:>9,.0f} "
          f"{_fmt(_ratio_to_rope(r, by_label_t), '.2f'):>6} {_fmt(r['mfu'], '.1%'):>6} "
          f"{_fmt(r['peak_gib'], '.1f'):>5} {r['loss_first']:>6.2f}>{r['loss_last']:<6.2f} "
          f"{r['compile_s']:>5.0f}  {r['attention_impl']}", flush=True)
