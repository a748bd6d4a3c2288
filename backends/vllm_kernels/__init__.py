"""Adapters that run vLLM's own MLA decode kernels, called the way vLLM 0.33.0's backends call them.

One module per vLLM backend family (`flashmla`, `flash_attn`, `triton`, `flashinfer_sm90`,
`cutlass`). Each imports vLLM and calls the kernel entry point that vLLM's backend
(`vllm/v1/attention/backends/mla/*.py`) calls, with its arguments, KV layout, query
quantization, head padding and scheduler metadata; nothing of vLLM's is copied.

They use the lowest vLLM modules that hold the kernels (`vllm.third_party.flashmla.
flash_mla_interface`, `torch.ops._flashmla_extension_C`, `vllm.vllm_flash_attn.
flash_attn_interface`, `vllm.v1.attention.ops.triton_decode_attention`), the very functions
vLLM's `vllm.v1.attention.ops.*` wrappers call, so that they also load from vLLM's unpacked
wheel on a machine whose torch vLLM does not support (there vLLM's platform is
"unspecified" and its wrappers report the kernels unavailable).

What `prepare` does untimed and vLLM does per step: metadata (the FlashMLA tile scheduler,
FA3's scheduler, top-k positions turned into global slots, FlashInfer's plan) which vLLM
builds once per step for all layers. What `run` does, as vLLM does per layer: query
quantization (FP8 FlashMLA), head padding copies, zeroing (vLLM's Triton path) and the kernel.
Converted cache layouts (fp8_ds_mla) are built untimed per rotated input set by `adopt`.
"""

from __future__ import annotations

import importlib

from mla_tune.backends.capabilities import MODULE_LABELS
from mla_tune.backends.interface import BackendUnavailable, DecodeInputs, check_inputs
from mla_tune.backends.problem import Problem


def load(module: str):
    """Import `module`; BackendUnavailable names exactly what did not load."""
    try:
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - ImportError, OSError from the loader, a broken install
        label = MODULE_LABELS.get(module, "vLLM's module" if module.startswith("vllm") else "module")
        if isinstance(exc, ModuleNotFoundError) and exc.name == module.split(".")[0]:
            raise BackendUnavailable(f"{exc.name} is not installed ({exc})") from exc
        raise BackendUnavailable(f"{label} {module} did not load: {type(exc).__name__}: {exc}") from exc


def check_problem(name: str, problem: Problem, inputs: DecodeInputs, *, sparse: bool) -> None:
    """Shape and dtype checks every vLLM adapter makes before any allocation."""
    check_inputs(problem, inputs)
    if problem.sparse != sparse:
        kind = "sparse" if problem.sparse else "dense"
        raise BackendUnavailable(f"{name} does not run {kind} problems")
    if not inputs.q.is_cuda:
        raise BackendUnavailable(f"{name} needs CUDA tensors, got q on {inputs.q.device}")


def global_slots(problem: Problem, inputs: DecodeInputs):
    """Top-k positions as global cache rows (page x page_size + offset), valid first then -1, with counts.

    Returns:
        `(slots, counts)`: int32 `[batch, q_len, topk]` and int32 `[batch, q_len]`, on q's device.
        vLLM's indexer output, converted by its `convert_logical_to_physical_topk`, has this form.
    """
    from mla_tune.backends.flashinfer_blackwell import packed_sparse_slots

    slots = packed_sparse_slots(inputs.block_table, inputs.seq_lens, inputs.topk_indices,
                                page_size=problem.page_size).to(inputs.q.device)
    return slots, (slots >= 0).sum(-1, dtype=slots.dtype)


def not_adopted(name: str):
    return ValueError(f"{name}.run got a KV cache it has not converted; call adopt(inputs) on every "
                      "rotated input set first (untimed)")
