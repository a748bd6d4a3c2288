"""The registry and the adapters against the real vLLM 0.33.0 package (marker `vllm`; .ci/vllm-tests runs them).

Capabilities are data taken from vLLM's backend classes; these tests read the classes and compare. They
run on the CPU: vLLM's platform is then not CUDA, so only class attributes and pure functions are used.
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="needs the real vLLM package (.ci/vllm-tests installs it)")

from mla_tune.backends.problem import Problem, normalize_kv_cache_dtype  # noqa: E402
from mla_tune.backends.registry import BACKENDS, backend_reasons  # noqa: E402

pytestmark = pytest.mark.vllm

# Our entries whose capabilities deliberately differ from the class, and why.
KNOWN_DIFFERENCES = {
    # The class admits majors 9 and 10; is_flashmla_dense_supported() admits Hopper only.
    ("FLASHMLA", "cc_majors"),
    # vLLM's MultipleOf(64) on Hopper; SM100 quantized caches need exactly 64 (get_supported_kernel_block_sizes).
}


def _backend_class(name: str):
    """vLLM's backend class, or (where its module needs CUDA to import) the class as its source defines it."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    try:
        return AttentionBackendEnum[name].get_class()
    except (ImportError, RuntimeError):
        return _class_from_source(AttentionBackendEnum[name].get_path())


_FACTS = ("supported_kv_cache_dtypes", "supports_compute_capability", "get_supported_kernel_block_sizes")


def _class_from_source(path: str):
    """The three class facts these tests read, from the class bodies in vLLM's source (no import of its modules):
    the class's own, else its bases' (a base imported from another module is followed there)."""
    import types

    cls_name = path.rpartition(".")[2]
    facts = _facts_from_source(path)
    assert len(facts) == 3, f"{path}: found only {sorted(facts)} in its class body and bases"
    return types.new_class(cls_name, (), {}, lambda ns: ns.update(facts))


def _facts_from_source(path: str) -> dict:
    import ast
    import importlib.util
    import pathlib

    from vllm.v1.attention.backend import MultipleOf

    module, _, cls_name = path.rpartition(".")
    tree = ast.parse(pathlib.Path(importlib.util.find_spec(module).origin).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    facts = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "supported_kv_cache_dtypes":
            facts["supported_kv_cache_dtypes"] = ast.literal_eval(node.value)
        elif isinstance(node, ast.FunctionDef) and node.name in _FACTS:
            node.decorator_list, node.returns = [], None
            for arg in node.args.args + node.args.kwonlyargs:
                arg.annotation = None
            namespace = {"MultipleOf": MultipleOf}
            exec(compile(ast.Module([node], []), path, "exec"), namespace)  # noqa: S102 - vLLM's own code
            fn = namespace[node.name]
            facts[node.name] = (staticmethod(fn) if node.name.startswith("get_")
                                else classmethod(fn))
    imported = {alias.asname or alias.name: f"{node.module}.{alias.name}" for node in tree.body
                if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}
    local = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    for base in (b.id for b in cls.bases if isinstance(b, ast.Name)):
        if len(facts) == 3:
            break
        where = f"{module}.{base}" if base in local else imported.get(base)
        if where and not where.endswith(".AttentionBackend"):
            facts = {**_facts_from_source(where), **facts}
    return facts


def _ours_kv(info) -> set[str]:
    return {kv for kv in info.capabilities.kv_cache_dtypes if kv != "fp8_ds_mla"}


def _theirs_kv(cls) -> set[str]:
    out = set()
    for spelling in cls.supported_kv_cache_dtypes:
        try:
            canonical = normalize_kv_cache_dtype(spelling)
        except ValueError:
            continue   # vLLM-only formats mla-tune does not model (nvfp4_ds_mla, turboquant_*)
        if canonical != "fp8_ds_mla":
            out.add(canonical)
    return out


VLLM_NAMED = sorted(name for name, info in BACKENDS.items() if info.vllm_name and name != "TOKENSPEED_MLA")


@pytest.mark.parametrize("name", VLLM_NAMED)
def test_kv_cache_dtypes_match_vllms_class(name):
    cls = _backend_class(name)
    assert _ours_kv(BACKENDS[name]) == _theirs_kv(cls), name


@pytest.mark.parametrize("name", VLLM_NAMED)
def test_compute_capability_matches_vllms_class(name):
    from vllm.platforms.interface import DeviceCapability

    cls = _backend_class(name)
    theirs = {major for major in range(7, 13) if cls.supports_compute_capability(DeviceCapability(major, 0))}
    ours = BACKENDS[name].capabilities.cc_majors
    if (name, "cc_majors") in KNOWN_DIFFERENCES:
        assert ours < theirs
    elif ours is None:
        assert theirs == set(range(7, 13))
    else:
        assert ours == theirs, name


@pytest.mark.parametrize("name", VLLM_NAMED)
def test_page_sizes_match_vllms_class(name):
    from vllm.v1.attention.backend import MultipleOf

    caps = BACKENDS[name].capabilities
    sizes = _backend_class(name).get_supported_kernel_block_sizes()
    fixed = {s for s in sizes if isinstance(s, int)}
    multiples = {s.base for s in sizes if isinstance(s, MultipleOf)}
    assert (caps.page_sizes or set()) == fixed, name
    assert ({caps.page_size_multiple} if caps.page_size_multiple else set()) == multiples, name


def test_vllm_names_exist_in_vllms_enum():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    for name, info in BACKENDS.items():
        if info.vllm_name:
            assert info.vllm_name in AttentionBackendEnum.__members__, name
    assert "MLA_TUNE_TRITON" not in AttentionBackendEnum.__members__


def test_adapter_constants_are_vllms():
    from vllm.config.attention import AttentionConfig
    from vllm.v1.attention.backends.mla import flashmla_sparse, triton_mla

    from mla_tune.backends.vllm_kernels import flash_attn, flashmla, triton

    assert flash_attn.MAX_NUM_SPLITS_FOR_CUDA_GRAPH == AttentionConfig().flash_attn_max_num_splits_for_cuda_graph
    assert triton.MIN_WORK_PER_SPLIT == triton_mla._MIN_WORK_PER_SPLIT
    assert triton.SPLIT_OCCUPANCY_MULTIPLIER == triton_mla._SPLIT_OCCUPANCY_MULTIPLIER
    assert flashmla.MIN_HEADS_FOR_BF16_PREFILL == flashmla_sparse.MIN_HEADS_FOR_BF16_PREFILL
    for heads in (1, 16, 32, 64, 65, 128):
        assert flashmla.fp8_sparse_padded_heads(heads) == \
            flashmla_sparse.FlashMLASparseImpl._compute_fp8_decode_padded_heads(heads)


def test_triton_split_rule_is_vllms():
    import triton as real_triton
    from vllm.v1.attention.backends.mla import triton_mla

    from mla_tune.backends.vllm_kernels.triton import num_kv_splits

    # vLLM's own function, with the real Triton where vLLM's placeholder (no GPU here) lacks next_power_of_2.
    def vllms(max_seq_len, sm_count):
        ideal = real_triton.next_power_of_2(max(1, max_seq_len // triton_mla._MIN_WORK_PER_SPLIT))
        return min(ideal, sm_count * triton_mla._SPLIT_OCCUPANCY_MULTIPLIER)

    for sm_count in (1, 78, 132):
        for max_seq_len in [*range(1, 5000, 37), *(2 ** k + d for k in range(22) for d in (-1, 0, 1))]:
            assert num_kv_splits(max_seq_len, sm_count) == vllms(max_seq_len, sm_count)


@pytest.mark.parametrize("name", ["FLASHMLA", "FLASHMLA_SPARSE", "FLASH_ATTN_MLA", "FLASH_ATTN_MLA_SPARSE",
                                  "TRITON_MLA"])
def test_the_real_wheel_has_every_file_the_hopper_adapters_load(name):
    problem = Problem(64, topk=2048 if "SPARSE" in name else None)
    from mla_tune.backends.problem import DeviceSpec

    assert backend_reasons(name, problem, DeviceSpec("NVIDIA H100 80GB HBM3", (9, 0))) == []


def test_vllms_own_layout_functions_describe_fp8_ds_mla_as_packed():
    from vllm.v1.attention.backends.mla.flashmla_sparse import FP8_DS_MLA_ROPE_DIM

    from mla_tune.backends.vllm_kernels.flashmla import DS_MLA_BYTES

    assert DS_MLA_BYTES == 512 + 4 * 4 + FP8_DS_MLA_ROPE_DIM * 2


_INTERPRETED = r'''
import torch
from mla_tune.backends.inputs import make_inputs
from mla_tune.backends.problem import Problem, Shape
from mla_tune.backends.reference import TorchReference
from mla_tune.backends.vllm_kernels.triton import _Prepared, load_triton_kernel
from mla_tune.tuner.gate import check_output

# fp16: the interpreter runs this kernel's bf16 loads as garbage (1e9-sized outputs), its fp16 ones exactly.
for heads, kv, q_len in ((16, "fp16", 1), (16, "fp8_e4m3", 2)):
    problem = Problem(heads, kv_cache_dtype=kv, query_dtype="fp16", q_len=q_len, page_size=16)
    inputs = make_inputs(problem, Shape(2, 150), seed=heads + q_len)
    out, lse = _Prepared(problem, inputs, load_triton_kernel(), sm_count=2).run(inputs)
    ref_out, ref_lse = TorchReference().prepare(problem, inputs).run(inputs)
    verdict = check_output(out, lse, ref_out, ref_lse, kv_cache_dtype=kv)
    print(kv, q_len, verdict.ok, verdict.rel_error, verdict.reason)
'''


def test_vllms_triton_kernel_with_our_arguments_matches_the_reference_in_the_interpreter():
    """TRITON_MLA's arguments, run through vLLM's kernel in Triton's interpreter (no GPU).

    vLLM keeps Triton when no driver is active only where CUDA_VISIBLE_DEVICES is set and empty (its
    distributed-start rule); that and TRITON_INTERPRET=1 make its kernel runnable on the CPU.
    """
    import os
    import subprocess
    import sys

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", _INTERPRETED], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2 and all(" True " in line for line in lines), done.stdout
