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
    fp8_quantizes_query: bool = False              # with FP8 KV the kernel reads q rounded to e4m3
    page_sizes: frozenset[int] | None = None
    page_size_multiple: int | None = None
    min_heads: int = 1
    max_heads: int | None = None
    forbidden_heads: tuple[tuple[int, int], ...] = ()  # inclusive ranges it cannot tile
    head_counts: frozenset[int] | None = None      # the only head counts it runs
    dense: bool = True
    sparse: bool = False
    sparse_topks: frozenset[int] | None = None
    sparse_topk_multiple: int | None = None        # top-k must be a multiple of this
    kv_lora_ranks: frozenset[int] | None = frozenset({512})
    qk_rope_head_dims: frozenset[int] | None = frozenset({64})
    qk_nope_head_dims: frozenset[int] | None = None
    max_q_len: int = 8
    required_modules: tuple[str, ...] = ()         # import names that must be installed (dotted: a file of a package)
    candidate: bool = True                         # False for the reference oracle


def _fmt(values) -> str:
    return "{" + ", ".join(str(v) for v in sorted(values)) + "}"


# How a reason names a module that is one file of a package (the kernels vLLM builds).
MODULE_LABELS = {
    "vllm._flashmla_C": "vLLM's FlashMLA extension",
    "vllm._flashmla_extension_C": "vLLM's FlashMLA FP8 extension",
    "vllm.vllm_flash_attn._vllm_fa3_C": "vLLM's FlashAttention 3 extension",
    "vllm._C_stable_libtorch": "vLLM's CUDA ops extension",
    "vllm.v1.attention.ops.triton_decode_attention": "vLLM's Triton MLA decode kernel",
    "vllm.third_party.flashmla.flash_mla_interface": "vLLM's FlashMLA interface",
    "vllm.vllm_flash_attn.flash_attn_interface": "vLLM's FlashAttention interface",
}


def missing_module_reason(module: str) -> str | None:
    """A sentence if `module` cannot be found, without importing it (nor its parents); None if found.

    A dotted name is looked up file by file under its top-level package's folders, so asking for
    `vllm._flashmla_C` runs no `vllm/__init__.py` (which imports torch). A folder of the top-level name
    without `__init__.py` (a namespace package, such as a test folder on sys.path) is not the package.
    """
    from importlib.machinery import PathFinder

    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)
        error = f"No module named {top!r}"
    except (ImportError, ValueError) as exc:  # a broken or half-installed package
        spec, error = None, str(exc)
    if spec is None:
        return f"{top} is not installed ({error})"
    if spec.origin in (None, "namespace"):  # every required package has an __init__.py; a bare folder is not it
        where = ", ".join(dict.fromkeys(spec.submodule_search_locations or ())) or "an unknown place"
        return f"{top} is not installed (no {top}/__init__.py in {where}: a folder of that name, not the package)"
    name = top
    for part in rest:
        locations = list(spec.submodule_search_locations or ())
        name = f"{name}.{part}"
        spec = PathFinder.find_spec(name, locations) if locations else None
        if spec is None:
            label = MODULE_LABELS.get(module, f"module {module}")
            where = ", ".join(locations) or f"{name.rsplit('.', 1)[0]} (not a package)"
            return f"{label} {module} is missing: no {name} under {where}"
    return None


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
    if caps.head_counts is not None and heads not in caps.head_counts:
        reasons.append(f"num_heads {heads} not in {_fmt(caps.head_counts)}")
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
    if problem.sparse and caps.sparse and caps.sparse_topk_multiple is not None \
            and problem.topk % caps.sparse_topk_multiple:
        reasons.append(f"top-k {problem.topk} is not a multiple of {caps.sparse_topk_multiple}")
    geo = problem.geometry
    for attr, allowed in (("kv_lora_rank", caps.kv_lora_ranks),
                          ("qk_rope_head_dim", caps.qk_rope_head_dims),
                          ("qk_nope_head_dim", caps.qk_nope_head_dims)):
        if allowed is not None and getattr(geo, attr) not in allowed:
            reasons.append(f"{attr} {getattr(geo, attr)} not in {_fmt(allowed)}")
    if problem.q_len > caps.max_q_len:
        reasons.append(f"q_len {problem.q_len} is above the maximum {caps.max_q_len}")
    if check_packages:
        missing: set[str] = set()
        for module in caps.required_modules:
            if module.split(".")[0] in missing:
                continue   # one sentence per absent package, not one per file of it
            reason = missing_module_reason(module)
            if reason:
                reasons.append(reason)
                if " is not installed (" in reason:
                    missing.add(module.split(".")[0])
    return reasons


@dataclass(frozen=True)
class BackendInfo:
    """One registry entry: the stable name, its capabilities and where its code lives."""

    name: str
    capabilities: Capabilities
    adapter: str | None = None          # "module:Class" of the runnable adapter, None if not runnable here
    vllm_name: str | None = None        # vLLM's `--attention-backend` value, when vLLM runs this very kernel
    # The name mla-tune's vLLM plugin registers for this kernel (handed to vLLM only with the plugin installed).
    vllm_plugin_name: str | None = None
    sglang_name: str | None = None      # SGLang's `--attention-backend` value, when SGLang has it
    summary: str = ""
    hardware: dict[str, str] = field(default_factory=dict)  # GPU family -> tested status
