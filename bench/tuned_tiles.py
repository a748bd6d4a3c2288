"""What the tuner's per-device refinement of TRITON_MLA stored, and the tiles read back through the runtime.

For every ok TRITON_MLA / TRITON_MLA_SPARSE measurement of the store: the shape, the default tile's time, the
chosen tile and its time, and the candidates left out. Then, per key, `mla_tune.kernel_tile` at each measured
shape, and `mla_decode(tile=...)` with that tile checked against the fp32 reference on this GPU.

    python3 bench/tuned_tiles.py sqlite:////path/to/tune.db
"""

from __future__ import annotations

import sys


def main(url: str) -> None:
    import torch

    import mla_tune
    from mla_tune.backends.inputs import make_inputs
    from mla_tune.backends.problem import Problem, Shape
    from mla_tune.backends.reference import mla_reference
    from mla_tune.backends.triton_mla import mla_decode
    from mla_tune.store.repository import Store
    from mla_tune.tuner.gate import check_output

    with Store.open(url) as store:
        rows = [m for m in store.measurements() if m.backend.startswith("TRITON_MLA") and m.params]
    print(f"# {torch.cuda.get_device_name()}, {len(rows)} refined measurements in {url}")
    print("kv        heads batch kv_len  default               ms     chosen                ms     gain  rejected")
    for m in sorted(rows, key=lambda m: (m.key.kv_cache_dtype, m.key.num_heads, m.batch_size, m.kv_len)):
        p = m.params
        default = p["default_median_ms"]
        gain = f"{default / m.median_ms:5.2f}x" if default else "    -"
        print(f"{m.key.kv_cache_dtype:9} {m.key.num_heads:5} {m.batch_size:5} {m.kv_len:6}  "
              f"{p['default_label']:20} {default or float('nan'):6.4f} {p['label']:20} {m.median_ms:6.4f} {gain}"
              f"  {len(p['rejected'])}/{p['candidates']}" + "".join(f"\n    left out {k}: {v}"
                                                                 for k, v in p["rejected"].items()))
    name = torch.cuda.get_device_name()
    cc = torch.cuda.get_device_capability()
    print("# read back: mla_tune.kernel_tile(...) -> mla_decode(tile=...) against the fp32 reference")
    for m in rows:
        k = m.key
        choice = mla_tune.kernel_tile(k.num_heads, k.kv_cache_dtype, batch_size=m.batch_size, kv_len=m.kv_len,
                                      device={"name": name, "compute_capability": cc}, db=url,
                                      sparse=k.topk > 0, page_size=k.page_size)
        problem = Problem(num_heads=k.num_heads, kv_cache_dtype=k.kv_cache_dtype, page_size=k.page_size,
                          topk=k.topk or None)
        inputs = make_inputs(problem, Shape(m.batch_size, m.kv_len), device=torch.device("cuda"), seed=5)
        out, lse = mla_decode(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens,
                              sm_scale=inputs.sm_scale, kv_scale=inputs.kv_scale, topk_indices=inputs.topk_indices,
                              tile=choice.tile)
        ref, ref_lse = mla_reference(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens,
                                     sm_scale=inputs.sm_scale, kv_scale=inputs.kv_scale,
                                     topk_indices=inputs.topk_indices)
        verdict = check_output(out, lse, ref, ref_lse, kv_cache_dtype=k.kv_cache_dtype)
        print(f"{k.kv_cache_dtype:9} {k.num_heads:5} {m.batch_size:5} {m.kv_len:6}  {choice.source:6} tile "
              f"{p_label(choice)}: rel err {verdict.rel_error:.1e}, {'passes' if verdict.ok else 'FAILS'} the gate")


def p_label(choice) -> str:
    t = choice.tile
    if t is None:
        return "default tile"
    return f"h{t['block_h']}n{t['block_n']}w{t['num_warps']}s{t['num_stages']}{'W' if t['warp_specialized'] else ''}" \
           f" min_split {t['min_split_tokens']}"


if __name__ == "__main__":
    main(sys.argv[1])
