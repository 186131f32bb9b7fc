"""The decode benchmark's arithmetic: the read bound and the fixed + bytes / rate fit."""
import pytest

from experiments.benchmarks import decode_speed

MIB = decode_speed.MIB


def _row(name, cache_mib, step_ms, param_mib=10.0):
  return dict(encoding=name, cache_mib=cache_mib, param_mib=param_mib, step_ms=step_ms)


def test_read_bound_is_bytes_over_bandwidth():
  # 1000 MiB + 24 MiB at 1024 MiB/ms (= 1.073741824e12 B/s): one millisecond.
  ms = decode_speed.read_bound_ms(cache_mib=1000, param_mib=24,
                                  bandwidth_gbs=1024 * MIB * 1e3 / 1e9)
  assert ms == pytest.approx(1.0)


def test_fit_recovers_the_fixed_part_and_the_rate():
  fixed, gbs = 0.4, 2000.0           # ms, GB/s
  rows = [_row("a", c, fixed + c * MIB / (gbs * 1e9) * 1e3) for c in (256.0, 1024.0, 4096.0)]
  rows.append(_row("b", 512.0, 1.0))   # one context: no line
  fits = decode_speed.fit_fixed_and_bandwidth(rows)
  assert set(fits) == {"a"}
  assert fits["a"][0] == pytest.approx(fixed, rel=1e-6)
  assert fits["a"][1] == pytest.approx(gbs, rel=1e-6)
