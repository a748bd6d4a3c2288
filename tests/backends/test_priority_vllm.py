"""Our pinned 0.33.0 table against the real vLLM 0.33.0's `_get_backend_priorities`, imported from the package.

How vLLM's function is reached on a machine without a GPU: `vllm.platforms.cuda`
imports `vllm._C_stable_libtorch` (vLLM's CUDA ops, which need libcuda.so.1) only to
register custom ops; nothing in `_get_backend_priorities` uses them. A child
process puts an empty module under that one name in `sys.modules` and then
imports the real `vllm.platforms.cuda`, so the function, its `@cache`, the real
`AttentionBackendEnum`, `DeviceCapability` and `is_quantized_kv_cache` are all
vLLM's own. It calls the function over the whole grid and prints the enum names;
this process compares them with `static_priority(..., vllm_version="0.33.0")`.
The stand-in stays in the child, so no other test sees it. The last three tests
check which rule `vllm_version=None` takes in the three situations of such an
environment: vLLM not loaded, loaded without libcuda, and loaded with its CUDA
platform importable (the same stand-in).

Run in an environment that has vLLM 0.33.0 and mla-tune installed:
`python -m pytest -m vllm tests/backends/test_priority_vllm.py`.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import vllm_priority_source as source

from mla_tune import static_priority

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed here")]

STUB_CUDA_OPS = ("import sys, types\n"
                 "sys.modules['vllm._C_stable_libtorch'] = types.ModuleType('vllm._C_stable_libtorch')\n")


def run_child_lines(code: str) -> list:
    """The JSON values a child interpreter prints, one a line."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.strip().splitlines()]


def run_child(code: str) -> dict:
    return run_child_lines(code)[-1]


@pytest.fixture(scope="module")
def vllm_lists():
    grid = (f"MAJORS, MINORS, HEADS, HEAD_SIZES, EXTRA = {source.MAJORS!r}, {source.MINORS!r}, {source.HEADS!r}, "
            f"{source.HEAD_SIZES!r}, {source.MLA_TUNE_SPELLINGS!r}\n")
    out = run_child(STUB_CUDA_OPS + grid + """
import json, typing
import vllm
from vllm.config.cache import CacheDType, KV_CACHE_DTYPES
from vllm.platforms.cuda import _get_backend_priorities
from vllm.platforms.interface import DeviceCapability
from vllm.v1.kv_cache_interface import is_quantized_kv_cache
literal = list(typing.get_args(CacheDType))
lists = {}
for major in MAJORS:
    for minor in MINORS:
        for dtype in literal + list(EXTRA):
            for heads in HEADS:
                for head_size in HEAD_SIZES:
                    found = _get_backend_priorities(use_mla=True, device_capability=DeviceCapability(major, minor),
                                                    num_heads=heads, kv_cache_dtype=dtype, use_non_causal=False,
                                                    head_size=head_size, use_mm_prefix=False)
                    lists[json.dumps([major, minor, dtype, heads, head_size])] = [b.name for b in found]
print(json.dumps({"version": vllm.__version__, "literal": literal, "registered": list(KV_CACHE_DTYPES),
                  "quantized": {d: is_quantized_kv_cache(d) for d in literal}, "lists": lists}))
""")
    if out["version"] != "0.33.0":
        pytest.skip(f"this comparison is for vLLM 0.33.0; vLLM {out['version']} is installed")
    return out


def test_0_33_0_table_matches_vllms_own_function_on_the_whole_grid(vllm_lists):
    mismatches = []
    for key, theirs in vllm_lists["lists"].items():
        major, minor, dtype, heads, head_size = json.loads(key)
        ours = static_priority(compute_capability=(major, minor), kv_cache_dtype=dtype, num_heads=heads,
                               head_size=head_size, vllm_version="0.33.0")
        if ours != theirs:
            mismatches.append((key, ours, theirs))
    assert not mismatches, mismatches[:5]
    assert len(vllm_lists["lists"]) == len(source.MAJORS) * len(source.MINORS) * len(source.HEADS) * \
        len(source.HEAD_SIZES) * (len(vllm_lists["literal"]) + len(source.MLA_TUNE_SPELLINGS))


def test_0_33_0_dtypes_and_quantized_test_match_vllm(vllm_lists):
    from mla_tune.backends.priority_tables import RELEASE_0_33_0

    assert RELEASE_0_33_0.kv_cache_dtypes == frozenset(vllm_lists["literal"]) == frozenset(vllm_lists["registered"])
    assert {d: RELEASE_0_33_0.quantized(d) for d in vllm_lists["literal"]} == vllm_lists["quantized"]


PROBE = """
import json
from mla_tune import static_priority
from mla_tune.backends.priority import priority_rule
rule = priority_rule(None)
cases = [((9, 0), "fp8_ds_mla", 64, 512), ((9, 0), "auto", 128, 576), ((10, 0), "auto", 16, 576),
         ((10, 0), "turboquant_k8v4", 128, 576), ((12, 1), "fp8", 32, None)]
print(json.dumps({"rule": [rule.vllm_version, rule.source, rule.description],
                  "lists": [static_priority(compute_capability=cc, kv_cache_dtype=kv, num_heads=h, head_size=s)
                            for cc, kv, h, s in cases],
                  "pinned": [static_priority(compute_capability=cc, kv_cache_dtype=kv, num_heads=h, head_size=s,
                                             vllm_version="0.33.0") for cc, kv, h, s in cases]}))
"""


def test_a_process_without_vllm_loaded_uses_the_installed_versions_table_and_loads_no_torch():
    out, loaded = run_child_lines(PROBE + "import sys; print(json.dumps([m for m in ('torch', 'triton', 'vllm') "
                                          "if m in sys.modules]))\n")
    assert out["rule"] == ["0.33.0", "pinned", "mla-tune's pinned table for vLLM 0.33.0, the installed version "
                           "(vLLM is not loaded in this process, and importing it only to ask would cost seconds)"]
    assert out["lists"] == out["pinned"]
    assert loaded == []


def test_with_vllm_loaded_but_no_libcuda_the_installed_versions_table_answers_and_says_why():
    out = run_child("import vllm\n" + PROBE)
    version, kind, description = out["rule"]
    assert (version, kind) == ("0.33.0", "pinned")
    assert description.startswith("mla-tune's pinned table for vLLM 0.33.0, the installed version "
                                  "(vLLM's own rule could not be loaded: ")
    assert "libcuda.so.1" in description
    assert out["lists"] == out["pinned"]


def test_with_vllm_loaded_and_its_cuda_platform_importable_its_own_function_answers():
    out = run_child(STUB_CUDA_OPS + "import vllm\n" + PROBE)
    assert out["rule"] == ["0.33.0", "installed", "the installed vLLM 0.33.0's own _get_backend_priorities"]
    assert out["lists"] == out["pinned"]
