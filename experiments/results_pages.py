r"""Builds every results folder's README.md and plots from its files, and the results index.

  python -m experiments.results_pages                   # every folder, then results/README.md
  python -m experiments.results_pages experiments/results/mqrar_gpu    # it and its sub-folders
  python -m experiments.results_pages --check           # write nothing; list what is stale

A folder holds results.json (the numbers), summaries.json (the runs, when a sweep wrote it),
provenance.json (command, machine, date and the config as it ran) and NOTES.md (hand-written
discussion). Its README is: title, verdict per paper claim, deviations from the paper (both
from experiments/claims/, the verdicts' numbers read from the JSON; the deviations' last line,
the seeds, counted from the runs), the tables and
plots (experiments/results_render.py), the runs, then NOTES.md. Nothing is typed twice, so a
README cannot drift from its JSON; tests/test_results_pages.py rebuilds every README and
compares.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import ml_collections

from experiments import claims as results_claims
from experiments import convert_pages
from experiments import results_render
from experiments import results_writers
from experiments.probes import pages as probe_pages

RESULTS_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
VERDICTS = ("reproduced", "partly", "contradicted", "untested")
TITLES = {"flipflop": "Flip-flop language modelling (PaTH Table 1)",
          "length_extrapolation": "Length extrapolation on the code corpus (acc_rot Table 1, "
                                  "PaTH Fig. 3, TAPA Tables 1-2)",
          "word_problem": "Word problems (PaTH Fig. 2 bottom)",
          "mqrar": "MQRAR-N-back (PaTH Fig. 2 top)",
          "distance_bias": "Distance bias (TAPA App. 15)",
          "mixing_window": "Mixing window of accumulated transports (acc_rot §8.3)",
          "convert": "Converting RoPE into PaTH by distillation (PaTH §4.3)"}


class Folder:
  """One results folder's files, read once."""

  def __init__(self, path: str):
    self.path = path
    with open(os.path.join(path, "results.json")) as f:
      self.results = json.load(f)
    prov_path = os.path.join(path, results_writers.PROVENANCE)
    if not os.path.exists(prov_path):
      raise ValueError(f"{prov_path} does not exist: a results folder needs the provenance "
                       "that experiments.sweeps (or the probe) writes beside results.json")
    with open(prov_path) as f:
      self.provenance = json.load(f)
    self.kind = self.provenance["experiment"]
    self.config = ml_collections.ConfigDict(self.provenance["config"])
    summaries = os.path.join(path, results_writers.SUMMARIES)
    self.summaries = None
    if os.path.exists(summaries):
      with open(summaries) as f:
        self.summaries = json.load(f)
    notes = os.path.join(path, "NOTES.md")
    self.notes = open(notes).read() if os.path.exists(notes) else None

  @property
  def seeds(self) -> tuple:
    """The seeds that ran (from the runs themselves: a later invocation's config may list
    fewer than the folder gathered)."""
    if self.summaries:
      return tuple(sorted({s.get("seed", 0) for s in self.summaries}))
    if "seeds" in self.results:   # results that count their seeds (convert: whole experiments)
      return tuple(range(self.results["seeds"]))
    if "sweep" in self.config:
      return tuple(self.config.sweep.get("seeds", ()) or (self.config.train.seed,))
    return ()


class Loader:
  """What a claims function reads: folders relative to the page's folder, opened once."""

  def __init__(self, path: str):
    self.path, self._open = path, {}

  def folder(self, sub: str = ".") -> Folder:
    if sub not in self._open:
      self._open[sub] = Folder(os.path.normpath(os.path.join(self.path, sub)))
    return self._open[sub]

  def results(self, sub: str = ".") -> dict:
    return self.folder(sub).results

  def seeds(self, sub: str = ".") -> int:
    return len(self.folder(sub).seeds)


def seed_counts(folder: Folder) -> str | None:
  """How many seeds the folder's runs have: "3", or "3 for rope, fox; 1 for tapa" when the
  encodings differ (from the runs themselves, so it follows every gather); None where the
  folder does not say (the probes: their deviations describe their models' seeds)."""
  if not folder.summaries:
    return str(len(folder.seeds)) if folder.seeds else None
  by_encoding = {}
  for s in folder.summaries:
    by_encoding.setdefault(s["encoding"], set()).add(s.get("seed", 0))
  groups = {}
  for encoding, ids in by_encoding.items():
    groups.setdefault(len(ids), []).append(encoding)
  if len(groups) == 1:
    return str(next(iter(groups)))
  return "; ".join(f"{n} for {', '.join(names)}" for n, names in sorted(groups.items(),
                                                                        reverse=True))


def seeds_line(load: Loader, sections) -> list[str]:
  """The deviations' "Seeds:" line of a page, from its section folders' runs ([] where they
  do not say): one count when they agree, else each folder's."""
  counts = {s.folder: seed_counts(load.folder(s.folder)) for s in sections
            if s.folder is not None}
  counts = {folder: n for folder, n in counts.items() if n is not None}
  if not counts:
    return []
  if len(set(counts.values())) == 1:
    return [f"Seeds: {next(iter(counts.values()))}."]
  return ["Seeds: " + "; ".join(f"{n} ({'this folder' if folder == '.' else folder + '/'})"
                                for folder, n in counts.items()) + "."]


def relative(path: str) -> str | None:
  """`path` relative to experiments/results, or None outside it (a sweep's scratch folder)."""
  rel = os.path.relpath(os.path.abspath(path), RESULTS_ROOT)
  return None if rel.startswith("..") else rel.replace(os.sep, "/")


def _section(folder: Folder, out_dir: str | None, *, img: str, notes: dict) -> list[str]:
  if folder.kind == "convert":
    return convert_pages.section(folder.config, folder.results, folder.provenance, out_dir,
                                 img=img)
  if folder.kind == "distance_bias":
    has_image = os.path.exists(os.path.join(folder.path, probe_pages.HISTOGRAMS))
    return probe_pages.distance_bias_section(folder.config, folder.results, folder.provenance,
                                             out_dir, img=img, has_image=has_image)
  if folder.kind == "mixing_window":
    return probe_pages.mixing_window_section(folder.config, folder.results, folder.provenance,
                                             out_dir, img=img)
  return (results_render.header(folder.config, folder.provenance, folder.seeds) + [""]
          + results_render.section(folder.kind, folder.results, folder.config, out_dir, img=img,
                                   notes=notes))


def _claims(spec, load: Loader, rel: str):
  """(verdicts, None), or (None, a line saying why not). New runs in a committed folder (other
  encodings, more seeds) must not cost the folder its README, nor the index; the tests fail on
  that line until experiments/claims/ is updated."""
  try:
    verdicts = spec.claims(load)
  except (KeyError, IndexError, ValueError, TypeError) as e:
    return None, (f"verdicts not computed ({type(e).__name__}: {e}): update the claims of "
                  f"{rel!r} in experiments/claims/ for these results")
  bad = [v.verdict for v in verdicts if v.verdict not in VERDICTS]
  if bad:
    raise ValueError(f"experiments/claims/ ({rel}): verdicts {bad} must be one of {VERDICTS}")
  return verdicts, None


def verdict_lines(verdicts) -> list[str]:
  lines = []
  for v in verdicts:
    seeds = (" One seed: a difference inside one seed's spread is not a finding."
             if v.seeds == 1 else f" {v.seeds} seeds." if v.seeds else "")
    lines.append(f"- **{v.verdict}** — {v.paper}: {v.claim}. Here: {v.evidence}.{seeds}")
  return lines


def page_text(path: str, *, plots: bool = False) -> str:
  """README.md of the folder at `path` (writing its plots there when `plots`)."""
  me = Folder(path)
  rel = relative(path)
  spec = results_claims.PAGES.get(rel) if rel else None
  load = Loader(path)
  title = spec.title if spec else TITLES.get(me.kind, me.kind)
  sources = [f for f in ("results.json", "summaries.json", "provenance.json", "NOTES.md")
             if os.path.exists(os.path.join(path, f))]
  command = f"python -m experiments.results_pages {'experiments/results/' + rel if rel else path}"
  lines = [f"# {title}", "",
           f"Generated from this folder's {', '.join(sources)} by `{command}`"
           + (" (verdicts and deviations: experiments/claims/)" if spec else "")
           + "; edit those, not this file.", ""]
  if spec:
    verdicts, error = _claims(spec, load, rel)
    lines += ["## Verdict", ""] + ([f"- {error}"] if error else verdict_lines(verdicts)) + [""]
  sections = spec.sections if spec else (results_claims.Section(),)
  if spec:
    lines += (["## Deviations from the paper", ""] + [f"- {d}" for d in spec.deviations]
              + [f"- {line}" for line in seeds_line(load, sections)] + [""])
  for s in sections:
    heading = s.heading or ("Results" if s.folder == "." else None)
    if heading:
      lines += [f"## {heading}", ""]
    if s.intro:
      lines += [s.intro, ""]
    if s.folder not in (None, "."):
      lines += [f"Folder [{s.folder}/]({s.folder}/README.md) (its own README has the runs).", ""]
    if s.folder is not None:
      img = "" if s.folder == "." else s.folder.rstrip("/") + "/"
      lines += _section(load.folder(s.folder), path if (plots and s.folder == ".") else None,
                        img=img, notes=dict(s.notes))
    if s.extra:
      lines += s.extra(load) + [""]
  if me.summaries:
    lines += results_writers.runs_table(me.summaries)
  if me.notes:
    lines += ["", me.notes.rstrip("\n")]
  return "\n".join(lines).rstrip("\n") + "\n"


def write_page(path: str) -> None:
  """Writes the folder's README.md and plots; for a committed folder, the index as well."""
  text = page_text(path, plots=True)
  with open(os.path.join(path, "README.md"), "w") as f:
    f.write(text)
  if relative(path) and os.path.exists(os.path.join(RESULTS_ROOT, "README.md")):
    with open(os.path.join(RESULTS_ROOT, "README.md"), "w") as f:
      f.write(index_text())


def folders(under: str | None = None) -> list[str]:
  """Every results folder at or below `under` (default: all; those with a provenance.json)."""
  out = []
  for root, _, files in os.walk(under or RESULTS_ROOT):
    if results_writers.PROVENANCE in files:
      out.append(root)
  return sorted(out)


def _where(f: Folder) -> str:
  """Devices and dates of a folder's runs, in a few words."""
  if f.summaries and any("device" in s for s in f.summaries):
    devices = sorted({s.get("device", "?") for s in f.summaries})
    days = sorted({s.get("finished", "?").split(" ")[0] for s in f.summaries})
  else:
    p = f.provenance
    devices = [(p.get("machine") or p["machine_line"]).split(" (")[0].split(", shared")[0]]
    days = re.findall(r"\d{4}-\d\d-\d\d", p.get("date") or p["machine_line"])[:1]
  return f"{', '.join(devices)}; {' to '.join(dict.fromkeys([days[0], days[-1]]))}"


def index_text() -> str:
  """experiments/results/README.md: every paper claim, its verdict and where the evidence is."""
  rows = []
  for rel, spec in results_claims.PAGES.items():
    if not spec.index:
      continue
    verdicts, error = _claims(spec, Loader(os.path.join(RESULTS_ROOT, rel)), rel)
    if error:
      rows.append(("-", error, "-", "-", f"[{rel}]({rel}/README.md)"))
    for v in verdicts or ():
      seeds = "1 seed" if v.seeds == 1 else f"{v.seeds} seeds" if v.seeds else "-"
      rows.append((v.paper, v.claim, f"**{v.verdict}**", f"{v.evidence} ({seeds})",
                   f"[{rel}]({rel}/README.md)"))
  rows += [(u.paper, u.claim, "**untested**", u.evidence, "-") for u in results_claims.UNTESTED]
  rows += [(v.paper, v.claim, f"**{v.verdict}**", v.evidence, f"`{where}`")
           for v, where in results_claims.ELSEWHERE]
  order = results_claims.PAPER_ORDER
  rows.sort(key=lambda r: order.index(r[0].split(" ")[0]) if r[0] != "-" else -1)
  table = ["| paper | claim | verdict | measured here | folder |", "|---|---|---|---|---|"]
  table += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
  where = ["| folder | setting | seeds | where and when |", "|---|---|---|---|"]
  for path in folders():
    f, rel = Folder(path), relative(path)
    if "sweep" not in f.config:
      continue
    where.append(f"| [{rel}]({rel}/README.md) | {results_render.setting(f.config)} | "
                 f"{len(f.seeds)} | {_where(f)} |")
  return "\n".join([results_claims.INDEX_INTRO.rstrip("\n"), "", "## Claims", ""] + table + [
      "", "## Folders", ""] + where + ["", results_claims.INDEX_OUTRO.rstrip("\n")]) + "\n"



def write_results(experiment: str, summaries: list[dict], config, out_dir: str,
                  prov: dict) -> dict:
  """results.json + provenance.json from the runs (results_writers), then the README and
  plots from those."""
  results = results_writers.aggregate(experiment, summaries, config)
  results_writers.save_results(out_dir, experiment, results, config, prov)
  write_page(out_dir)
  return results

def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("folders", nargs="*", help="results folders (default: all under "
                 "experiments/results); each one's sub-folders are rebuilt too")
  p.add_argument("--check", action="store_true", help="write nothing; exit 1 naming every "
                 "README that differs from what its files say")
  args = p.parse_args(argv)
  targets = sorted({f for d in (args.folders or [RESULTS_ROOT]) for f in folders(d)})
  if args.folders and not targets:
    print(f"error: no provenance.json at or below {args.folders}", file=sys.stderr)
    return 2
  stale = []
  for path in targets:
    if args.check:
      with open(os.path.join(path, "README.md")) as f:
        if f.read() != page_text(path):
          stale.append(os.path.join(path, "README.md"))
    else:
      write_page(path)
      print(f"wrote {os.path.join(path, 'README.md')}")
  index = os.path.join(RESULTS_ROOT, "README.md")
  if args.check:
    with open(index) as f:
      if f.read() != index_text():
        stale.append(index)
    for s in stale:
      print(f"stale: {s}")
    return 1 if stale else 0
  with open(index, "w") as f:
    f.write(index_text())
  print(f"wrote {index}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
