"""Probe (device): can Triton launch a Gluon kernel as a cooperative grid, inside a CUDA graph, and what does a
per-group barrier of atomics cost? A prerequisite of merging the split partials inside stage 1.

    python3 bench/coop_probe.py
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _group_barrier(cnt_ptr, out_ptr, GROUP: gl.constexpr, SYNC: gl.constexpr):
    pid = gl.program_id(0)
    g = pid // GROUP
    c = GROUP
    if SYNC:
        gl.atomic_add(cnt_ptr + g, 1, sem="release", scope="gpu")
        c = gl.atomic_add(cnt_ptr + g, 0, sem="acquire", scope="gpu")
        while c < GROUP:
            c = gl.atomic_add(cnt_ptr + g, 0, sem="acquire", scope="gpu")
        done = gl.atomic_add(cnt_ptr + g, 1, sem="acq_rel", scope="gpu")
        if done == 2 * GROUP - 1:
            gl.atomic_xchg(cnt_ptr + g, 0, sem="relaxed", scope="gpu")
    gl.store(out_ptr + pid, c)


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for group in (2, 16, 32):
        grid = (sms // group) * group
        cnt = torch.zeros(grid // group, dtype=torch.int32, device="cuda")
        out = torch.zeros(grid, dtype=torch.int32, device="cuda")
        for sync in (False, True):
            def run():
                _group_barrier[(grid,)](cnt, out, GROUP=group, SYNC=sync, num_warps=4, launch_cooperative_grid=True)
            run()
            torch.cuda.synchronize()
            ok = bool((out >= group).all()) and int(cnt.abs().sum()) == 0
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(20):
                    run()
            graph.replay()
            torch.cuda.synchronize()
            ok = ok and int(cnt.abs().sum()) == 0
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            us = start.elapsed_time(end) * 1000 / 200
            print(f"grid {grid} group {group} sync {sync}: {us:.2f} us a kernel in a graph, counters reset and "
                  f"every program saw its group: {ok}")


if __name__ == "__main__":
    main()
