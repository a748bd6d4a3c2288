"""FA3 sparse at batch 4 read 3.1 us in hopper_dev.py and ~20 us in kernels.py (device call 283). Which is right?

For one sparse shape, each adapter (ours, FlashInfer FA3) is timed three ways: (1) as hopper_dev.py times it
(`triton_dev.capture` + `time_steps`), (2) as kernels.py does (`timing.capture_graph` default + `time_interleaved`),
(3) 20 direct launches on rotating input sets between CUDA events. Then the output buffer is zeroed, each graph is
replayed once and its output checked against the reference: a graph that does not compute fails that check.

    python3 bench/sparse_small_probe.py 128 bf16 4 32768     # heads, KV dtype, batch, kv_len
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import triton_dev  # noqa: E402

from mla_tune.backends.flashinfer_mla import FlashInferFA3Sparse  # noqa: E402
from mla_tune.backends.problem import Problem, Shape  # noqa: E402
from mla_tune.backends.triton_mla.adapter import TritonMLASparse  # noqa: E402
from mla_tune.tuner import timing  # noqa: E402
from mla_tune.tuner.gate import check_output  # noqa: E402


def main():
    heads, kv, batch, kv_len = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    case = triton_dev.Case(Problem(heads, kv, page_size=64, q_len=1, topk=2048), Shape(batch, kv_len), ragged=False)
    print(f"# sparse h{heads} {kv} b{batch} kv{kv_len}: {len(case.sets)} input sets, roofline "
          f"{case.roofline_us(*triton_dev.measure_machine()):.1f} us")
    for name, adapter in (("ours", TritonMLASparse()), ("fa3", FlashInferFA3Sparse())):
        prepared, result = triton_dev.check(case, adapter)
        print(name, "check:", result["status"], f"err {result['err']:.1e}")
        dev_graph = triton_dev.capture(prepared.run, case.sets)
        dev = triton_dev.time_steps({"g": dev_graph})["g"]
        k_graph = timing.capture_graph(lambda: [prepared.run(s) for s in case.sets],
                                       iterations_per_replay=len(case.sets))
        k = timing.time_interleaved({"g": k_graph}, rel_ci_target=0.01, max_seconds=0.6)["g"]
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = 20
        torch.cuda.synchronize()
        start.record()
        for i in range(n):
            prepared.run(case.sets[(i + 1) % len(case.sets)])
        stop.record()
        torch.cuda.synchronize()
        direct = start.elapsed_time(stop) * 1e3 / n
        print(f"{name}: hopper_dev way {dev[0]:.1f} us, kernels.py way {k.median_ms * 1e3:.1f} us, "
              f"direct launches {direct:.1f} us a launch")
        for label, graph in (("hopper_dev graph", dev_graph), ("kernels.py graph", k_graph)):
            out, lse = prepared.out, prepared.lse
            out.zero_()
            lse.zero_()
            graph()
            torch.cuda.synchronize()
            verdict = check_output(out, lse, case.ref, case.ref_lse, kv_cache_dtype=kv)
            print(f"  {label} replayed on zeroed outputs: {'right' if verdict.ok else 'WRONG: ' + verdict.reason}")
        del dev_graph, k_graph


if __name__ == "__main__":
    main()
