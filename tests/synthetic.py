"""Synthetic sweeps with known answers, written through the real sweep code."""

from wavetune_jax import MATMUL as FULL_MATMUL
from wavetune_jax import MatmulProblem, get_hardware
from wavetune_jax.tuning import sweep
from wavetune_jax.tuning.profiler import Measurement

HW = get_hardware("h100")
#: The synthetic latencies are functions of Triton configs: the GEMM family
#: with its Triton backend only (files name the family, so readers of these
#: sweeps find the full family and keep the backends the file measured).
MATMUL = FULL_MATMUL.with_backends(["triton"])


def wave_us(p, c):
  """A wave-shaped latency: fixed cost + waves x L x per-tile cost."""
  g, l = MATMUL.coords(p, c)
  waves = -(-g // HW.num_sms)
  return 2.0 + waves * l * 0.1 * (c.block_m * c.block_n) / 4096 + c.num_stages * 0.01


def config_only_us(p, c):
  """Latency that ranks configs the same way for every problem."""
  return (1.0 + abs(c.block_m - 64) + abs(c.block_n - 128) / 2 + abs(c.block_k - 64) / 4
          + c.split_k + c.num_warps / 8 + c.num_stages / 16) * (p.m + 10)


def fails(p, c) -> bool:
  return hash((p, c)) % 7 == 0


class FakeMeasure:
  """Measures with ``latency``; one config in seven fails to compile; can 'crash'."""

  def __init__(self, latency=wave_us, crash_after=None, with_failures=True):
    self.latency = latency
    self.calls = []
    self.crash_after = crash_after
    self.with_failures = with_failures

  def __call__(self, problem, configs, with_baseline):
    for c in configs:
      if self.crash_after is not None and len(self.calls) >= self.crash_after:
        raise KeyboardInterrupt
      self.calls.append((problem, c))
      if self.with_failures and fails(problem, c):
        yield "pallas", c, Measurement(status="compile_error", error="OutOfResources: smem")
      else:
        t = self.latency(problem, c)
        yield "pallas", c, Measurement(status="ok", median_us=t, spread_us=0.01 * t,
                                       samples=20, compile_s=0.1, rel_error=1e-3)
    # with_baseline: True, or the baseline impls the sweep lacks
    for impl in (("baseline",) if with_baseline is True else with_baseline or ()):
      yield impl, None, Measurement(status="ok", median_us=5.0, spread_us=0.1,
                                          samples=20)


def header():
  return sweep.make_header(MATMUL, HW, jax_version="0.0", command="wavetune sweep (test)")


def write_sweep(path, problems, measure):
  sweep.run_sweep(MATMUL, problems, HW, sweep.SweepFile(path, header()), measure)
  return path


WEIGHTS = [(256, 512), (512, 256), (384, 640)]
MS = [1, 64, 300, 2000]
PROBLEMS = [MatmulProblem(m=m, n=n, k=k) for n, k in WEIGHTS for m in MS]
