"""Does a backend's time drift under sustained load? Time it in rounds for a while, reading clocks.

Question it answers (issue 3): on the H200 our FlashInfer FA3 time for bf16, 128 heads, batch 128,
kv_len 16384 is ~15% below REFERENCE.md section 5 (1140.7 us), while the bandwidth-bound shapes match.
A compute-heavy kernel run for long stretches may be power-capped to lower SM clocks; our benchmark
times short bursts. This runs each shape for `--seconds`, in rounds of `time_interleaved` (the one
place that times), and prints each round's median with the SM clock, power and temperature NVML
reads right after it.

Usage (GPU): python3 bench/sustained.py --seconds 20
"""

from __future__ import annotations

import argparse
import time

import pynvml
import torch

from mla_tune.backends.flashinfer_mla import FlashInferFA3
from mla_tune.backends.inputs import make_inputs
from mla_tune.backends.problem import Problem, Shape
from mla_tune.tuner.timing import capture_graph, time_interleaved

SHAPES = [(128, 128, 16384, 1140.7), (128, 64, 4096, 142.0), (16, 64, 4096, 79.7)]  # heads, batch, kv, REFERENCE us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="sustained time per shape")
    args = parser.parse_args()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    print(f"# {pynvml.nvmlDeviceGetName(handle)}, power limit "
          f"{pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000:.0f} W, FA3 bf16 uniform lengths")
    print("heads batch kv_len  t_s  median_us  sm_mhz  power_w  temp_c  reference_us")
    for heads, batch, kv_len, reference_us in SHAPES:
        problem = Problem(num_heads=heads, kv_cache_dtype="bf16")
        inputs = make_inputs(problem, Shape(batch, kv_len), device="cuda", seed=1, ragged=False)
        prepared = FlashInferFA3().prepare(problem, inputs)
        step = capture_graph(lambda p=prepared, i=inputs: p.run(i), min_replay_ms=20.0)
        start = time.monotonic()
        while (elapsed := time.monotonic() - start) < args.seconds:
            timing = time_interleaved({"fa3": step}, max_seconds=1.0, max_samples=50)["fa3"]
            clock = pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
            power = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000
            temp = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
            print(f"{heads:5} {batch:5} {kv_len:6} {elapsed:4.0f} {timing.median_ms * 1000:10.1f} "
                  f"{clock:7} {power:8.0f} {temp:7} {reference_us:13.1f}", flush=True)
        del prepared, inputs, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
