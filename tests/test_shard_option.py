"""conftest's --shard I/N (what .ci/gpu uses to split the GPU class over device calls): the
shards are disjoint, cover every test and keep collection order; a bad value names the option."""
import pathlib

pytest_plugins = ["pytester"]

CONFTEST = (pathlib.Path(__file__).parent / "conftest.py").read_text()


def _run(pytester, *args):
  pytester.makeconftest(CONFTEST)
  pytester.makepyfile(test_five="\n".join(f"def test_{i}(): pass" for i in range(5)))
  return pytester.runpytest_inprocess("-p", "no:xdist", "-p", "no:cacheprovider", "-v", *args)


def _passed(result):
  return [line.split("::")[1].split()[0] for line in result.outlines if " PASSED" in line]


def test_shards_split_the_run_in_order(pytester):
  shards = [_passed(_run(pytester, "--shard", f"{i}/2")) for i in (1, 2)]
  assert shards == [["test_0", "test_2", "test_4"], ["test_1", "test_3"]]


def test_bad_shard_is_a_usage_error(pytester):
  result = _run(pytester, "--shard", "3/2")
  assert result.ret != 0
  result.stderr.fnmatch_lines(["*--shard='3/2': expected I/N*"])
