"""Declared capabilities of an MLA backend, and the one eligibility checker.

A backend's limits are data (a frozen `Capabilities`); `eligibility_reasons`
turns a (capabilities, problem, device) triple into a list of sentences, one
per violated limit, each naming the observed value. An empty list means
eligible. It never raises and never imports a kernel library.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from mla_tune.backends.problem import DeviceSpec, Problem


@dataclass(frozen=True)
class Capabilities:
    """What one backend can run. `None` in a field means "no limit"."""

    cc_majors: frozenset[int] | None = None      # compute-capability majors it runs on
    min_cc: tuple[int, int] | None = None          # lowest compute capability
    query_dtypes: frozenset[str] = frozenset({"bf16", "fp16"})
    kv_cache_dtypes: frozenset[str] = frozenset({"bf16", "fp16"})
    fp8_needs_bf16_query: bool = False             # FP8 KV only with a bf16 query
    fp8_cc_majors: frozenset[int] | None = None    # FP8 KV only on these majors
    fp8_min_cc: tuple[int, int] | None = None      # FP8 KV only from this compute capability
    page_sizes: frozenset[int] | None = None
    page_size_multiple: int | None = None
    min_heads: int = 1
    max_heads: int | None = None
    forbidden_heads: tuple[tuple[int, int], ...] = ()  # inclusive ranges it cannot tile
    dense: bool = True
    sparse: bool = False
    sparse_topks: frozenset[int] | None = None
    kv_lora_ranks: frozenset[int] | None = frozenset({512})
    qk_rope_head_dims: frozenset[int] | None = frozenset({64})
    qk_nope_head_dims: frozenset[int] | None = None
    max_q_len: int = 8
    required_modules: tuple[str, ...] = ()         # import names that must be installed
    candidate: bool = True                         # False for the reference oracle


def _fmt(values) -> str:
    return "{" + ", ".join(str(v) for v in sorted(values)) + "}"


def missing_module_reason(module: str) -> str | None:
    """A sentence if `module` cannot be found, without importing it; None if found."""
    try:
        found = importlib.util.find_spec(module) is not None
        error = f"No module named {module!r}"
    except (ImportError, ValueError) as exc:  # a parent package is missing or broken
        found, error = False, str(exc)
    if found:
        return None
    return f"{module.split('.')[0]} is not installed ({error})"


def eligibility_reasons(caps: Capabilities, problem: Problem, device: DeviceSpec | None,
                        *, check_packages: bool = True) -> list[str]:
    """Every reason `caps` cannot run `problem` on `device`; empty means eligible.

    Args:
        caps: the backend's declared capabilities.
        problem: the decode problem.
        device: the GPU; None skips the device checks (listing without a GPU).
        check_packages: also check that required modules are installed.
    """
    reasons: list[str] = []
    if device is not None:
        cc = device.compute_capability
        if caps.cc_majors is not None and cc[0] not in caps.cc_majors:
            reasons.append(f"compute capability {device.cc_label} is not supported "
                           f"(needs major {_fmt(caps.cc_majors)})")
        elif caps.min_cc is not None and cc < caps.min_cc:
            reasons.append(f"compute capability {device.cc_label} is below the minimum "
                           f"{caps.min_cc[0]}.{caps.min_cc[1]}")
    if problem.query_dtype not in caps.query_dtypes:
        reasons.append(f"query dtype {problem.query_dtype} not in {_fmt(caps.query_dtypes)}")
    kv = problem.kv_cache_dtype
    if kv not in caps.kv_cache_dtypes:
        reasons.append(f"kv_cache_dtype {kv} not in {_fmt(caps.kv_cache_dtypes)}")
    elif kv.startswith("fp8"):
        if caps.fp8_needs_bf16_query and problem.query_dtype != "bf16":
            reasons.append(f"FP8 KV cache needs a bf16 query, got {problem.query_dtype}")
        if device is not None and caps.fp8_cc_majors is not None \
                and device.compute_capability[0] not in caps.fp8_cc_majors:
            reasons.append(f"FP8 KV cache is not supported on compute capability {device.cc_label} "
                           f"(only major {_fmt(caps.fp8_cc_majors)})")
        if device is not None and caps.fp8_min_cc is not None and device.compute_capability < caps.fp8_min_cc:
            reasons.append(f"FP8 KV cache needs compute capability {caps.fp8_min_cc[0]}.{caps.fp8_min_cc[1]} "
                           f"or newer, got {device.cc_label}")
    if caps.page_sizes is not None and problem.page_size not in caps.page_sizes:
        reasons.append(f"page_size {problem.page_size} not in {_fmt(caps.page_sizes)}")
    if caps.page_size_multiple is not None and problem.page_size % caps.page_size_multiple:
        reasons.append(f"page_size {problem.page_size} is not a multiple of {caps.page_size_multiple}")
    heads = problem.num_heads
    if heads < caps.min_heads:
        reasons.append(f"num_heads {heads} is below the minimum {caps.min_heads}")
    if caps.max_heads is not None and heads > caps.max_heads:
        reasons.append(f"num_heads {heads} is above the maximum {caps.max_heads}")
    for low, high in caps.forbidden_heads:
        if low <= heads <= high:
            reasons.append(f"num_heads {heads} is in {low}..{high}, which the kernel cannot tile")
    if problem.sparse and not caps.sparse:
        reasons.append(f"sparse attention (top-k {problem.topk}) is not supported")
    if not problem.sparse and not caps.dense:
        reasons.append("dense (non-sparse) attention is not supported")
    if problem.sparse and caps.sparse and caps.sparse_topks is not None \
            and problem.topk not in caps.sparse_topks:
        reasons.append(f"top-k {problem.topk} not in {_fmt(caps.sparse_topks)}")
    geo = problem.geometry
    for attr, allowed in (("kv_lora_rank", caps.kv_lora_ranks),
                          ("qk_rope_head_dim", caps.qk_rope_head_dims),
                          ("qk_nope_head_dim", caps.qk_nope_head_dims)):
        if allowed is not None and getattr(geo, attr) not in allowed:
            reasons.append(f"{attr} {getattr(geo, attr)} not in {_fmt(allowed)}")
    if problem.q_len > caps.max_q_len:
        reasons.append(f"q_len {problem.q_len} is above the maximum {caps.max_q_len}")
    if check_packages:
        for module in caps.required_modules:
            reason = missing_module_reason(module)
            if reason:
                reasons.append(reason)
    return reasons


@dataclass(frozen=True)
class BackendInfo:
    """One registry entry: the stable name, its capabilities and where its code lives."""

    name: str
    capabilities: Capabilities
    adapter: str | None = None          # "module:Class" of the runnable adapter, None if not runnable here
    vllm_name: str | None = None        # vLLM's `--attention-backend` value, when vLLM has it
    sglang_name: str | None = None      # SGLang's `--attention-backend` value, when SGLang has it
    summary: str = ""
    # Said whenever the engine's name is printed: where the engine's backend of that name
    # runs other code than the one mla-tune timed.
    engine_caveat: str = ""
    hardware: dict[str, str] = field(default_factory=dict)  # GPU family -> tested status
