"""The one place that times: CUDA graphs, cold L2, interleaved replays, medians with CIs.

Everything that measures a kernel calls this module (STYLE.md "one place that
times"). The protocol:

1. `cold_l2_sets` makes copies of an input set (q + KV) until the bytes the
   launches read over one pass are at least three times the L2 size, so every
   launch reads from HBM (`l2_rotation_copies` says how many).
2. `capture_graph` captures one pass over the rotation (warm-up and JIT
   happen before capture), repeated inside the graph until one replay lasts
   about `min_replay_ms`, so that launch overhead and event resolution vanish.
3. `time_interleaved` replays every candidate's graph round-robin, the order
   rotating each round so clock and thermal drift favour no one, timing each
   replay with CUDA events, until every median's distribution-free confidence
   interval is within `rel_ci_target` of it or the time cap is reached. Every
   round times every candidate, so all medians cover the same stretch of time:
   a candidate dropped once it converged would keep only early samples while
   a slower-to-converge one also took late ones, under whatever drift the
   clocks had by then.

Tests inject a fake bench: any callable with `time_interleaved`'s signature
(see `fake_bench`). Without CUDA, `time_interleaved` falls back to wall-clock
timing of plain calls, which is only good for tests.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping

L2_ROTATION_FACTOR = 3          # rotation bytes >= this x L2 bytes
MAX_ROTATION_COPIES = 512       # 3 x 50 MiB over 0.6 MB (FP8, one request of 1k tokens) wants 267


@dataclass(frozen=True)
class Timing:
    """Per-iteration times of one candidate, in milliseconds.

    Attributes:
        median_ms: median over samples.
        ci_low_ms, ci_high_ms: the distribution-free confidence interval of the median.
        samples: number of samples (graph replays).
        iterations_per_sample: decode steps per sample (each sample is divided by it).
        all_ms: every sample's per-iteration time, in measurement order.
    """

    median_ms: float
    ci_low_ms: float
    ci_high_ms: float
    samples: int
    iterations_per_sample: int
    all_ms: tuple

    @property
    def rel_ci_half_width(self) -> float:
        """Half the CI width relative to the median (0.01 = +-1 %)."""
        return (self.ci_high_ms - self.ci_low_ms) / 2 / self.median_ms if self.median_ms > 0 else math.inf

    @property
    def spread_ms(self) -> tuple[float, float]:
        """The 10th and 90th percentile of the samples."""
        xs = sorted(self.all_ms)
        return _quantile(xs, 0.1), _quantile(xs, 0.9)


def _quantile(sorted_xs, q: float) -> float:
    pos = (len(sorted_xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def median_ci(samples_ms, confidence: float = 0.95) -> tuple[float, float, float]:
    """Median and its order-statistic confidence interval (no distribution assumed).

    The interval is [x_(k), x_(n-k+1)] with the largest k whose binomial(n, 1/2)
    tail P(B <= k-1) is at most (1 - confidence) / 2; with too few samples for
    a narrower one (n < 9 at 95 %) it is the full range.

    Returns:
        `(median, low, high)`.

    Raises:
        ValueError: no samples, or confidence outside (0, 1).
    """
    xs = sorted(float(x) for x in samples_ms)
    n = len(xs)
    if n == 0:
        raise ValueError("median_ci needs at least one sample")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    tail = (1 - confidence) / 2
    k, cdf = 0, 0.0
    for j in range(n // 2 + 1):            # cdf = P(B <= j)
        cdf += math.comb(n, j) / 2 ** n
        if cdf > tail:
            break
        k = j + 1
    k = max(k, 1)
    return statistics.median(xs), xs[k - 1], xs[n - k]


def l2_rotation_copies(bytes_read_per_set: int, l2_bytes: int | None = None,
                       free_bytes: int | None = None, *, bytes_per_copy: int | None = None,
                       factor: int = L2_ROTATION_FACTOR, max_copies: int = MAX_ROTATION_COPIES) -> int:
    """How many input sets (the original included) to rotate through to keep L2 cold.

    Args:
        bytes_read_per_set: bytes one launch reads from its set (see `inputs.bytes_touched`: a sparse step reads
            only the rows its top-k names, far less than its KV cache).
        l2_bytes: L2 size; None reads it from the current CUDA device (50 MiB if unknown).
        free_bytes: memory available for the extra copies; None = unlimited.
        bytes_per_copy: what one more set costs in memory (q + KV cache, `inputs.input_set_bytes`); None = the
            bytes read.
        factor: the bytes read over the rotation should cover at least factor x L2.
        max_copies: upper bound.

    Returns:
        At least 1; fewer than wanted when memory runs short.
    """
    if bytes_read_per_set <= 0:
        raise ValueError(f"bytes_read_per_set must be positive, got {bytes_read_per_set}")
    if l2_bytes is None:
        l2_bytes = device_l2_bytes()
    wanted = max(1, math.ceil(factor * l2_bytes / bytes_read_per_set))
    if free_bytes is not None:
        wanted = min(wanted, 1 + max(0, int(free_bytes)) // (bytes_per_copy or bytes_read_per_set))
    return max(1, min(wanted, max_copies))


def cold_l2_sets(inputs, *, free_bytes: int | None = None, l2_bytes: int | None = None) -> list:
    """The input sets a timed graph rotates through: `inputs` first, then copies of its q and KV cache, until the
    bytes the launches read over one pass reach `L2_ROTATION_FACTOR` x L2 (memory and `MAX_ROTATION_COPIES`
    permitting)."""
    from mla_tune.backends.inputs import bytes_touched, clone_data, input_set_bytes

    copies = l2_rotation_copies(bytes_touched(inputs), l2_bytes, free_bytes,
                                bytes_per_copy=input_set_bytes(inputs))
    return clone_data(inputs, copies)


def device_l2_bytes(device=None) -> int:
    """L2 size of the CUDA device in bytes (50 MiB, an H100's, when it cannot be read)."""
    try:
        import torch

        if torch.cuda.is_available():
            size = int(getattr(torch.cuda.get_device_properties(device or torch.cuda.current_device()),
                               "L2_cache_size", 0))
            if size > 0:
                return size
    except Exception:  # noqa: BLE001 - a missing property must not stop timing
        pass
    return 50 * 1024 * 1024


class GraphStep:
    """A captured CUDA graph; calling it replays `iterations_per_replay` decode steps.

    `keepalive` holds what the graph's kernels read and write: the captured step's results and the step itself, so
    the prepared backend it closes over (its workspaces, FlashInfer's plan buffers) lives as long as the graph. A
    caller that drops its own reference to the backend after capture must not leave the graph replaying freed memory:
    FlashInfer's sparse graphs then fail with cudaErrorInvalidAddressSpace, or time a kernel reading garbage.
    """

    def __init__(self, graph, iterations_per_replay: int, keepalive):
        self.graph = graph
        self.iterations_per_replay = iterations_per_replay
        self._keepalive = keepalive

    def __call__(self) -> None:
        self.graph.replay()


def _capture(step: Callable[[], object], repeats: int):
    import torch

    graph = torch.cuda.CUDAGraph()
    results = []
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            results.append(step())
    return graph, results


def capture_graph(step: Callable[[], object], *, iterations_per_replay: int = 1,
                  warmup: int = 2, min_replay_ms: float = 0.5,
                  max_repeats: int = 64) -> GraphStep:
    """Capture `step` in a CUDA graph, repeated until one replay lasts `min_replay_ms`.

    Args:
        step: launches `iterations_per_replay` decode steps (one pass over the
            L2 rotation); it must not allocate or synchronise.
        iterations_per_replay: decode steps one call of `step` launches.
        warmup: eager calls before capture (lazy init, autotuning caches).
        min_replay_ms: repeat `step` inside the graph until a replay lasts this long.
        max_repeats: upper bound on those repeats.

    Returns:
        A `GraphStep` whose `iterations_per_replay` counts every step in the graph.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("capture_graph needs a CUDA device (torch.cuda.is_available() is False)")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph, keep = _capture(step, 1)
    repeats = 1
    if min_replay_ms > 0:
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        once_ms = max(start.elapsed_time(end), 1e-3)
        repeats = min(max_repeats, max(1, math.ceil(min_replay_ms / once_ms)))
        if repeats > 1:
            del graph, keep
            graph, keep = _capture(step, repeats)
    return GraphStep(graph, iterations_per_replay * repeats, (keep, step))


def _converged(samples: list[float], rel_ci_target: float, min_samples: int) -> bool:
    if len(samples) < min_samples:
        return False
    med, low, high = median_ci(samples)
    return med > 0 and (high - low) / 2 <= rel_ci_target * med


def time_interleaved(steps: Mapping[str, Callable[[], object]], *, rel_ci_target: float = 0.01,
                     max_seconds: float = 2.0, min_samples: int = 5, max_samples: int = 100,
                     warmup: int = 3) -> dict[str, Timing]:
    """Time every candidate round-robin until every median is known to `rel_ci_target`.

    Args:
        steps: name -> callable launching one sample (a `GraphStep`, or any
            callable; `iterations_per_replay` on it divides the sample).
        rel_ci_target: stop once every candidate's 95 % CI half-width <= this x its median.
        max_seconds: wall-clock cap for the whole loop (warm-up excluded).
        min_samples: samples each candidate gets at least (time cap permitting one round).
        max_samples: rounds after which the loop stops (every candidate has one sample a round).
        warmup: untimed calls of each candidate first.

    Returns:
        name -> `Timing` in milliseconds per decode step.
    """
    if not steps:
        return {}
    names = list(steps)
    try:
        import torch

        on_cuda = torch.cuda.is_available()
    except ImportError:
        on_cuda = False
    for name in names:
        for _ in range(warmup):
            steps[name]()
    if on_cuda:
        torch.cuda.synchronize()
    per_sample = {name: int(getattr(steps[name], "iterations_per_replay", 1)) for name in names}
    samples: dict[str, list[float]] = {name: [] for name in names}
    deadline = time.perf_counter() + max_seconds
    round_index = 0
    while True:
        shift = round_index % len(names)
        order = names[shift:] + names[:shift]
        if on_cuda:
            events = []
            for name in order:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                steps[name]()
                end.record()
                events.append((name, start, end))
            torch.cuda.synchronize()
            for name, start, end in events:
                samples[name].append(start.elapsed_time(end) / per_sample[name])
        else:
            for name in order:
                t0 = time.perf_counter()
                steps[name]()
                samples[name].append((time.perf_counter() - t0) * 1e3 / per_sample[name])
        round_index += 1
        if round_index >= max_samples or time.perf_counter() > deadline or all(
                _converged(samples[n], rel_ci_target, min_samples) for n in names):
            break
    result = {}
    for name in names:
        med, low, high = median_ci(samples[name])
        result[name] = Timing(med, low, high, len(samples[name]), per_sample[name],
                              tuple(samples[name]))
    return result


def fake_bench(medians_ms: Mapping[str, float] | Callable[[str], float], *,
               rel_spread: float = 0.0, call_steps: bool = True) -> Callable[..., dict[str, Timing]]:
    """A bench with `time_interleaved`'s signature that returns given medians (for tests).

    Args:
        medians_ms: name -> median, or a function of the name.
        rel_spread: CI half-width relative to the median.
        call_steps: call each step once, so that a broken step still raises.
    """
    def bench(steps, *, rel_ci_target=0.01, max_seconds=2.0, min_samples=5, max_samples=100,
              warmup=3):
        out = {}
        for name, step in steps.items():
            if call_steps:
                step()
            med = medians_ms(name) if callable(medians_ms) else medians_ms[name]
            out[name] = Timing(med, med * (1 - rel_spread), med * (1 + rel_spread), min_samples, 1,
                               tuple([med] * min_samples))
        return out

    return bench


def measure_copy_bandwidth_gbs(*, size_bytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written), median of `repeats`."""
    import torch

    n = size_bytes // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del src, dst
    return 2 * n * 2 / (statistics.median(times) * 1e-3) / 1e9


def measure_matmul_tflops(*, size: int = 8192, repeats: int = 10, e4m3: bool = False) -> float:
    """Dense matmul rate in TFLOP/s (size x size x size), median of `repeats`: bf16, or with `e4m3` e4m3 operands
    (`torch._scaled_mm`, bf16 out), the ceiling of kernels that round the query to e4m3."""
    import torch

    a = torch.randn(size, size, device="cuda")
    b = torch.randn(size, size, device="cuda")
    if e4m3:
        one = torch.ones((), device="cuda")
        a, b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # _scaled_mm's B is column-major

        def matmul():
            torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    else:
        a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
        c = torch.empty_like(a)

        def matmul():
            torch.matmul(a, b, out=c)
    for _ in range(3):
        matmul()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        matmul()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 2 * size ** 3 / (statistics.median(times) * 1e-3) / 1e12
