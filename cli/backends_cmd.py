"""`mla-tune backends`: every backend, and whether it can run a problem on a GPU."""

from __future__ import annotations

import click

from mla_tune.cli.output import print_json, table, warn
from mla_tune.cli.params import ComputeCapability, problem_options


@click.command()
@click.option("--cc", "compute_capability", type=ComputeCapability(), default=None,
              help="Compute capability to check against (default: the local GPU's).")
@problem_options(heads_required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def backends(compute_capability, num_heads, kv_cache_dtype, sparse, topk, page_size, query_dtype,
             as_json) -> None:
    """List every MLA backend with `eligible` or the reasons it cannot run the problem.

    Without --cc the local GPU is probed; without a GPU the device checks are
    skipped and only the problem is checked.

    Example: mla-tune backends --cc 9.0 --heads 64 --kv-cache-dtype fp8
    """
    from mla_tune.backends.problem import DeviceSpec, Problem
    from mla_tune.backends.registry import BACKENDS, backend_reasons
    from mla_tune.runtime import DEFAULT_SPARSE_TOPK

    try:
        problem = Problem(num_heads=num_heads, kv_cache_dtype=kv_cache_dtype, query_dtype=query_dtype,
                          page_size=page_size, topk=(topk or DEFAULT_SPARSE_TOPK) if (sparse or topk) else None)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    device = None
    if compute_capability is not None:
        device = DeviceSpec(f"compute capability {compute_capability[0]}.{compute_capability[1]}",
                            compute_capability)
    else:
        from mla_tune.tuner.probe import ProbeError, local_device

        try:
            device = local_device().spec
        except ProbeError as exc:
            warn(f"{exc}; device checks skipped (pass --cc X.Y)")
    rows = []
    for name, info in BACKENDS.items():
        reasons = backend_reasons(name, problem, device)
        rows.append({"backend": name, "eligible": not reasons, "reasons": reasons,
                     "vllm_name": info.vllm_name, "sglang_name": info.sglang_name,
                     "runnable_here": info.adapter is not None, "summary": info.summary})
    if as_json:
        print_json({"device": None if device is None else {"name": device.name, "compute_capability":
                                                           list(device.compute_capability)},
                    "problem": {"num_heads": problem.num_heads, "kv_cache_dtype": problem.kv_cache_dtype,
                                "query_dtype": problem.query_dtype, "page_size": problem.page_size,
                                "topk": problem.topk},
                    "backends": rows})
        return
    where = device.name if device is not None else "any GPU (device not checked)"
    mode = f"sparse top-k {problem.topk}" if problem.sparse else "dense"
    title = (f"{problem.num_heads} heads, {problem.kv_cache_dtype} KV, {problem.query_dtype} query, "
             f"page {problem.page_size}, {mode}, on {where}")
    table(title, ["backend", "status", "vLLM name"],
          [[r["backend"], "eligible" if r["eligible"] else "; ".join(r["reasons"]), r["vllm_name"] or "-"]
           for r in rows])
