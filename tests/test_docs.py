"""docs/encodings.md and its family pages (docs/encodings/*.md) against the code: the registry
table, the links, and no outside citations.

The pages are the project's own statement of what each encoding computes; these checks keep
them from drifting: the table lists exactly the registry's names, families, hyperparameters
and defaults, every link between the pages and every reference to them from anywhere in the
tree names a heading of the page it points at, every `tests/...::test_name` they cite exists,
and no tracked text file points readers at reference files that live outside the repository.
"""
import ast
import pathlib
import re
import subprocess

from posenc_jax import encodings
from posenc_jax.encodings import additive
from posenc_jax.encodings import phase
from posenc_jax.encodings import rotary
from posenc_jax.encodings import stick_breaking
from posenc_jax.encodings import transport

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "encodings.md"
PAGES = [DOC, *sorted((ROOT / "docs" / "encodings").glob("*.md"))]
# Being rewritten by their owners; the check covers them once they are.
EXCLUDED = ()   # every tracked file
# Split so that this file does not match itself.
OUTSIDE_REFERENCES = re.compile("SPEC" + r"\.md|/work/" + "shared|papers/\\w+\\.txt")

DEFAULTS = {"nope": {}, "kv_shift": {}, "tapa": phase.HPARAMS, "tapa_linear": phase.HPARAMS,
            **rotary.HPARAMS, **additive.HPARAMS, **transport.HPARAMS, **stick_breaking.HPARAMS}


def _tracked_files():
  """Repository-relative paths of the tracked files (a plain walk where git is unavailable)."""
  try:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p]
  except (OSError, subprocess.CalledProcessError):
    skip = (".git", ".venv", "__pycache__", "workdirs")
    return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
            if p.is_file() and not any(part in skip or part.endswith(".egg-info")
                                       for part in p.relative_to(ROOT).parts)]


def _text_files():
  """(path, text) of every tracked UTF-8 file outside EXCLUDED, the pages themselves included."""
  paths = set(_tracked_files()) | {str(p.relative_to(ROOT)) for p in PAGES}
  for rel in sorted(paths):
    if rel.startswith(EXCLUDED) or not (ROOT / rel).is_file():
      continue
    try:
      yield rel, (ROOT / rel).read_text(encoding="utf-8")
    except UnicodeDecodeError:
      continue  # images and other binary files


def _slugs(markdown: str) -> set[str]:
  """The anchors GitHub gives the headings: lower case, punctuation dropped, spaces to '-'."""
  seen: dict[str, int] = {}
  fenced = False
  for line in markdown.splitlines():
    if line.startswith("```"):
      fenced = not fenced
    m = None if fenced else re.match(r"#{1,6} (.*)", line)
    if m:
      slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
      n = seen.get(slug, 0)
      seen[slug] = n + 1
      if n:
        seen[f"{slug}-{n}"] = 1
  return set(seen)


def _registry_rows(markdown: str) -> dict[str, list[str]]:
  """name -> the cells of its row in the table under "## The registry at a glance"."""
  section = markdown.split("\n## The registry at a glance\n", 1)[-1].split("\n## ", 1)[0]
  rows = {}
  for line in section.splitlines():
    m = re.match(r"\| `(\w+)` \|", line)
    if m:
      rows[m.group(1)] = [c.strip() for c in line.strip().strip("|").split("|")]
  return rows


def test_no_tracked_file_cites_a_file_outside_the_repository():
  hits = [f"{rel}:{n}: {line.strip()[:80]}"
          for rel, text in _text_files()
          for n, line in enumerate(text.splitlines(), 1) if OUTSIDE_REFERENCES.search(line)]
  assert not hits, ("these lines cite files outside the repository; point them at "
                    "docs/encodings.md (or state the fact) instead:\n" + "\n".join(hits))


def test_registry_table_matches_the_registry():
  assert set(DEFAULTS) == set(encodings.NAMES), (
      "an encoding's hyperparameter defaults are not known to tests/test_docs.py: add its "
      f"module's HPARAMS to DEFAULTS ({sorted(set(encodings.NAMES) ^ set(DEFAULTS))})")
  rows = _registry_rows(DOC.read_text(encoding="utf-8"))
  assert set(rows) == set(encodings.NAMES), (
      f"docs/encodings.md's registry table lacks {sorted(set(encodings.NAMES) - set(rows))}")
  for name, (_, family, hparams, _) in rows.items():
    want_family = encodings.get(name).family
    assert family == want_family, (
        f"{name}: the page says family {family!r}, the registry {want_family!r}")
    listed = {k: ast.literal_eval(v) for k, v in re.findall(r"`(\w+)=([^`]*)`", hparams)}
    assert listed == dict(DEFAULTS[name]), (
        f"{name}: the page lists {listed}, the registry's defaults are {dict(DEFAULTS[name])}")


def test_links_between_the_pages_and_into_them_resolve():
  """A markdown link [..](page.md#anchor) inside the pages, and a docs/encodings[/page].md#anchor
  written anywhere in the tree, points at a page that exists and at one of its headings."""
  anchors = {p.resolve(): _slugs(p.read_text(encoding="utf-8")) for p in PAGES}

  def check(target: pathlib.Path, anchor: str) -> bool:
    return target.resolve() in anchors and (not anchor or anchor in anchors[target.resolve()])

  broken = []
  for page in PAGES:
    for target, anchor in re.findall(r"\]\(([\w./-]*\.md|)(?:#([\w-]+))?\)",
                                     page.read_text(encoding="utf-8")):
      if not check(page.parent / target if target else page, anchor):
        broken.append(f"{page.relative_to(ROOT)}: ({target}#{anchor})")
  for rel, text in _text_files():
    for target, anchor in re.findall(r"(docs/encodings(?:/\w+)?\.md)#([\w-]+)", text):
      if not check(ROOT / target, anchor):
        broken.append(f"{rel}: {target}#{anchor}")
  assert not broken, f"links to pages or headings that do not exist: {broken}"


def test_cited_tests_exist():
  cited = [c for p in PAGES for c in re.findall(r"(tests/[\w/]+\.py)::(\w+)",
                                               p.read_text(encoding="utf-8"))]
  assert cited, "the pages cite no tests"
  missing = [f"{path}::{fn}" for path, fn in cited
             if not (ROOT / path).is_file() or f"def {fn}(" not in (ROOT / path).read_text()]
  assert not missing, f"the encoding pages cite tests that do not exist: {missing}"
