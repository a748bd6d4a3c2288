"""Experiment: where the FP8-query narrow form's cycles go, per partition (clock64 probes, PROBE constexpr)."""
import sys
from pathlib import Path

import torch

from mla_tune.backends.inputs import make_inputs
from mla_tune.backends.problem import Problem, Shape
from mla_tune.backends.registry import load_adapter
from mla_tune.backends.triton_mla import launcher

SHAPES = [(16, 128, 16384), (32, 128, 16384), (32, 16, 16384), (32, 128, 4096), (128, 64, 4096)]
print("heads batch kv  progs tiles/prog  us/launch  cyc/tile | mma: full-wait qk softmax pv | ld0: empty copy transpose other")
for heads, batch, kv in SHAPES:
    problem = Problem(num_heads=heads, kv_cache_dtype="fp8_e4m3", page_size=64)
    inputs = make_inputs(problem, Shape(batch, kv), device="cuda", seed=0, ragged=False)
    launcher.PROBE_BUFFER.clear()
    runner = load_adapter("MLA_TUNE_TRITON_FP8Q")().prepare(problem, inputs)
    for _ in range(3):
        runner.run(inputs)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        runner.run(inputs)
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1000 / 20
    buf = torch.zeros(1 << 22, dtype=torch.int32, device="cuda")
    launcher.PROBE_BUFFER["t"] = buf
    runner.run(inputs)
    runner.run(inputs)
    torch.cuda.synchronize()
    start.record()
    for _ in range(20):
        runner.run(inputs)
    end.record()
    torch.cuda.synchronize()
    us_probe = start.elapsed_time(end) * 1000 / 20
    launcher.PROBE_BUFFER.clear()
    v = buf.view(-1, 8).double()
    v = v[v[:, 7] > 0]
    tot = v[:, 0].sum().item()
    tiles = v[:, 7].sum().item()
    f = lambda i: v[:, i].sum().item() / tot
    softmax = 1 - f(1) - f(2) - f(3)
    other = 1 - f(4) - f(5) - f(6)
    print(f"{heads:5d} {batch:5d} {kv:5d} {len(v):6d} {tiles / len(v):8.1f}  {us:7.1f} ({us_probe:6.1f} probed) "
          f"{tot / tiles:7.0f} | {f(1):.2f} {f(2):.2f} {softmax:.2f} {f(3):.2f} | {f(4):.2f} {f(5):.2f} {f(6):.2f} {other:.2f}",
          flush=True)
