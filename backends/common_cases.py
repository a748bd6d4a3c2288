"""vLLM's static choice for the common cases: DeepSeek-style heads x KV dtype x GPU family.

What `mla-tune` prints on a machine without an NVIDIA GPU, and what the
README's support matrix starts from. Package availability is not checked:
the table says what vLLM would pick on that GPU with its kernels installed.
"""

from __future__ import annotations

from dataclasses import dataclass

from mla_tune.backends.priority import static_choice
from mla_tune.backends.problem import DeviceSpec, Problem

# Representative GPUs of each family vLLM distinguishes (name as NVML reports it).
COMMON_DEVICES = (
    DeviceSpec("NVIDIA A100-SXM4-80GB", (8, 0)),
    DeviceSpec("NVIDIA L40S", (8, 9)),
    DeviceSpec("NVIDIA H100 80GB HBM3", (9, 0)),
    DeviceSpec("NVIDIA H200", (9, 0)),
    DeviceSpec("NVIDIA B200", (10, 0)),
    DeviceSpec("NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0)),
)
COMMON_HEADS = (128, 64, 32, 16)          # DeepSeek-V3/R1 per rank at TP 1/2/4/8
COMMON_KV_CACHE_DTYPES = ("bf16", "fp8")
SPARSE_TOPK = 2048                         # DeepSeek-V3.2


@dataclass(frozen=True)
class StaticCase:
    """vLLM's static choice for one (GPU, KV dtype, dense/sparse, heads) case."""

    device: DeviceSpec
    kv_cache_dtype: str
    sparse: bool
    num_heads: int
    backend: str | None          # None: nothing in vLLM's list can run it
    skipped: dict[str, list[str]]  # backends before it in the list, and why


def common_static_choices(devices=COMMON_DEVICES, *, heads=COMMON_HEADS,
                          kv_cache_dtypes=COMMON_KV_CACHE_DTYPES, sparse=(False, True)) -> list[StaticCase]:
    """vLLM's static choice for every combination, devices outermost."""
    cases = []
    for device in devices:
        for kv in kv_cache_dtypes:
            for is_sparse in sparse:
                for num_heads in heads:
                    problem = Problem(num_heads=num_heads, kv_cache_dtype=kv,
                                      topk=SPARSE_TOPK if is_sparse else None)
                    static = static_choice(problem, device, kv_cache_spelling=kv)
                    cases.append(StaticCase(device, kv, is_sparse, num_heads, static.backend, static.skipped))
    return cases
