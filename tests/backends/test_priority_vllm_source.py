"""Our pinned table against vLLM's own `_get_backend_priorities`, read from an installed vLLM's source text.

Runs without importing vLLM (see `vllm_priority_source`): the vLLM of this
environment, or the package directory in `$MLA_TUNE_VLLM_PACKAGE`; skipped when
there is none, or when mla-tune has no pinned table for its version.
"""

from __future__ import annotations

import pytest
import vllm_priority_source as source

from mla_tune import static_priority
from mla_tune.backends.priority import table_for_installed

PACKAGE = source.package_dir()
pytestmark = pytest.mark.skipif(PACKAGE is None, reason=f"no vLLM installed here and ${source.PACKAGE_ENV} unset")


@pytest.fixture(scope="module")
def vllm_rule():
    version = source.version(PACKAGE)
    table = table_for_installed(version)
    if table is None:
        pytest.skip(f"mla-tune has no pinned priority table for the installed vLLM {version}")
    return table, *source.load(PACKAGE)


def test_pinned_table_matches_vllm_source_on_the_whole_grid(vllm_rule):
    table, get_priorities, _, cache_dtypes = vllm_rule
    checked = 0
    for major, minor, dtype, heads, head_size in source.grid(cache_dtypes):
        theirs = get_priorities(use_mla=True, device_capability=source.DeviceCapability(major, minor),
                                num_heads=heads, kv_cache_dtype=dtype, use_non_causal=False, head_size=head_size,
                                use_mm_prefix=False)
        ours = static_priority(compute_capability=(major, minor), kv_cache_dtype=dtype, num_heads=heads,
                               head_size=head_size, vllm_version=table.version)
        assert ours == list(theirs), (major, minor, dtype, heads, head_size)
        checked += 1
    assert checked == len(source.MAJORS) * len(source.MINORS) * len(source.HEADS) * len(source.HEAD_SIZES) * \
        (len(cache_dtypes) + len(source.MLA_TUNE_SPELLINGS))


def test_pinned_dtypes_and_quantized_test_match_vllm_source(vllm_rule):
    table, _, is_quantized, cache_dtypes = vllm_rule
    assert table.kv_cache_dtypes == frozenset(cache_dtypes)
    assert {d: table.quantized(d) for d in cache_dtypes} == {d: is_quantized(d) for d in cache_dtypes}
