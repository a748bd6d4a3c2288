"""Fake MLA backends for the tuner's CPU tests: real adapter classes on CPU tensors.

They go through the real worker, gate and store code; only the GPU timing is
replaced, by `fake_bench` (the `time_interleaved` signature), whose times come
from the `MLA_TUNE_FAKE_MS` environment variable (JSON: backend -> ms, or
backend -> {"<batch>": ms, "default": ms}) so that a test sets them before
workers spawn. The worker bound (through `CUDA_VISIBLE_DEVICES`) to the GPU
named by `MLA_TUNE_FAKE_SLOW_GPU` reports 1.5x those times;
`MLA_TUNE_FAKE_DELAY_S` makes every shape take that long.
"""

from __future__ import annotations

import ctypes
import json
import os
import time
from dataclasses import dataclass

from mla_tune.backends.reference import mla_reference


class _Prepared:
    def __init__(self, problem, scale: float = 1.0, hang_in_run: bool = False, abort_on_call: int = 0):
        self.problem, self.scale, self.hang_in_run = problem, scale, hang_in_run
        self.abort_on_call, self.calls = abort_on_call, 0

    def run(self, inputs):
        self.calls += 1
        if self.calls == self.abort_on_call:
            os.abort()
        if self.hang_in_run:
            time.sleep(3600)
        out, lse = mla_reference(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens,
                                 sm_scale=inputs.sm_scale, kv_lora_rank=self.problem.geometry.kv_lora_rank,
                                 kv_scale=inputs.kv_scale, topk_indices=inputs.topk_indices)
        return (out * self.scale).to(inputs.q.dtype), lse


class FakeGood:
    """Correct (it is the reference in disguise)."""

    name = "FAKE_GOOD"

    def prepare(self, problem, inputs):
        return _Prepared(problem)


class FakeOther(FakeGood):
    name = "FAKE_OTHER"


class FakeThird(FakeGood):
    name = "FAKE_THIRD"


class FakeLiar:
    """Runs, but its output is 10% too large: the gate must mark it incorrect."""

    name = "FAKE_LIAR"

    def prepare(self, problem, inputs):
        return _Prepared(problem, scale=1.1)


class FakeAbort:
    """Aborts the process at prepare, like a failed CUDA assertion in a native library."""

    name = "FAKE_ABORT"

    def prepare(self, problem, inputs):
        os.write(2, b"fake kernel: device-side assertion failed, aborting\n")
        os.abort()


class FakeSegfault:
    """Dereferences NULL through ctypes (a segfault in native code)."""

    name = "FAKE_SEGFAULT"

    def prepare(self, problem, inputs):
        ctypes.string_at(0)


class FakeHang:
    """Prepares, then hangs in its first run (a kernel that never finishes)."""

    name = "FAKE_HANG"

    def prepare(self, problem, inputs):
        return _Prepared(problem, hang_in_run=True)


class FakeLateAbort:
    """Correct at the gate (first run), then aborts in its second run: inside the timing."""

    name = "FAKE_LATE_ABORT"

    def prepare(self, problem, inputs):
        return _Prepared(problem, abort_on_call=2)


class FakeRaise:
    """Raises a plain Python error at prepare."""

    name = "FAKE_RAISE"

    def prepare(self, problem, inputs):
        raise RuntimeError("fake library cannot plan this problem")


class _FakeParams:
    def __init__(self, label: str):
        self._label = label

    def label(self) -> str:
        return self._label


class FakeVllmLaunch:
    """The launch a fake vLLM backend makes of FAKE_TILED: correct unless `SCALE` says otherwise; its time comes
    from MLA_TUNE_FAKE_MS as `FAKE_TILED@vllm`."""

    SCALE = 1.0

    def __init__(self, max_seq_len):
        self.max_seq_len = max_seq_len

    def prepare(self, problem, inputs):
        return _Prepared(problem, scale=self.SCALE)


class FakeTiled:
    """A backend with candidate tiles, as our Triton kernel has: tile 0 (its default) is correct, tile 1 lies
    (10% too large), tile 2 raises at prepare, tile 3 is correct; their times come from MLA_TUNE_FAKE_MS by
    step name (`FAKE_TILED#i`). `vllm_launch` is the launch a vLLM backend would make of it."""

    name = "FAKE_TILED"
    TILES = ((64, 64), (64, 32), (32, 32), (16, 32))

    def __init__(self, params=None):
        self.params = params

    def vllm_launch(self, *, max_seq_len):
        return FakeVllmLaunch(max_seq_len)

    def tile_candidates(self, problem, inputs):
        from collections import namedtuple

        tile = namedtuple("Tile", "block_h block_n")
        return [(tile(*t), _FakeParams(f"h{t[0]}n{t[1]}")) for t in self.TILES]

    def prepare(self, problem, inputs):
        label = self.params.label() if self.params else "h64n64"
        if label == "h32n32":
            raise RuntimeError("fake tile does not fit")
        return _Prepared(problem, scale=1.1 if label == "h64n32" else 1.0)


ADAPTERS = {cls.name: f"fake_mla_backends:{cls.__name__}" for cls in
            (FakeGood, FakeOther, FakeThird, FakeLiar, FakeAbort, FakeSegfault, FakeHang, FakeRaise,
             FakeLateAbort, FakeTiled)}


@dataclass(frozen=True)
class FakeTiming:
    median_ms: float
    ci_low_ms: float
    ci_high_ms: float
    samples: int
    iterations_per_sample: int = 1
    all_ms: tuple = ()


def fake_bench(steps, *, rel_ci_target=0.01, max_seconds=1.0, **_):
    """Run every step once (the real adapter code) and return the configured times."""
    table = json.loads(os.environ.get("MLA_TUNE_FAKE_MS", "{}"))
    delay = float(os.environ.get("MLA_TUNE_FAKE_DELAY_S", "0"))
    result = {}
    for name, step in steps.items():
        out, _ = step()
        batch = int(out.shape[0])
        entry = table.get(name, 1.0)
        if isinstance(entry, dict):
            entry = entry.get(str(batch), entry.get("default", 1.0))
        ms = float(entry)
        if os.environ.get("CUDA_VISIBLE_DEVICES") == os.environ.get("MLA_TUNE_FAKE_SLOW_GPU", "-"):
            ms *= 1.5
        result[name] = FakeTiming(ms, ms * 0.998, ms * 1.002, 20)
    if delay:
        time.sleep(delay)
    return result
