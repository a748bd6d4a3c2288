"""The fp8_ds_mla kernel (`mla_tune.backends.triton_mla.ds_mla`) against its float32 reference.

On CPU it runs in Triton's interpreter (in a subprocess: the interpreter is chosen before Triton is imported),
where the products are float32, so the check is tight: it tests the layout (e4m3 bytes, the four tile scales,
the bf16 RoPE), the top-k gather through a permuted block table, masking and the softmax. With a GPU the same
cases run on it with bf16 products.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CASES = {
    # name: (tokens, heads, topk, block_size, lengths, spaced blocks, block_n)
    "h5_topk70": (3, 5, 70, 64, [200, 75, 130], False, 32),
    "h19_spaced_blocks": (2, 19, 100, 64, [333, 101], True, 32),
    "h67_two_head_blocks": (2, 67, 48, 16, [49, 90], False, 16),
}

RUN = r"""
import json, sys, torch
from mla_tune.backends.triton_mla.ds_mla import ds_mla_reference, ds_mla_sparse_decode, pack_fp8_ds_mla

def case(tokens, heads, topk, block_size, lengths, spaced, block_n, device):
    g = torch.Generator().manual_seed(heads * 31 + topk)
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + 3
    stride_blocks = 2 if spaced else 1          # other layers' pages between this cache's blocks
    store = pack_fp8_ds_mla(torch.randn(num_blocks * stride_blocks, block_size, 576, generator=g) * 3)
    cache = store[::stride_blocks] if spaced else store
    order = torch.randperm(num_blocks, generator=g)
    table, start = [], 0
    for count in needed:
        table.append(order[start:start + count]); start += count
    rows = torch.full((tokens, topk), -1, dtype=torch.int32)
    stride_rows = cache.stride(0) // 656
    for t in range(tokens):
        n = lengths[t % len(lengths)]
        if t == tokens - 1 and tokens > 2:
            continue                               # a token whose indexer found nothing
        picked = torch.randperm(n, generator=g)[:topk]
        blocks = table[t % len(lengths)][picked // block_size]
        rows[t, :picked.numel()] = (blocks * stride_rows + picked % block_size).to(torch.int32)
    rows = rows[:, torch.randperm(topk, generator=g)].contiguous()  # -1 entries anywhere, not only at the end
    q = torch.randn(tokens, heads, 576, generator=g).to(torch.bfloat16)
    ref_out, ref_lse = ds_mla_reference(q, cache, rows, sm_scale=0.0721)
    out, lse = ds_mla_sparse_decode(q.to(device), cache.to(device), rows.to(device), sm_scale=0.0721,
                                    block_n=block_n)
    finite = torch.isfinite(ref_lse)
    return {"out": (out.cpu().float() - ref_out).abs().max().item(),
            "out_scale": ref_out.abs().max().item(),
            "lse": (lse.cpu() - ref_lse)[finite].abs().max().item(),
            "empty_rows_ok": bool(torch.equal(torch.isfinite(lse.cpu()), finite)
                                  and out.cpu()[~finite].abs().max().item() == 0 if (~finite).any() else True)}

device = sys.argv[2]
print(json.dumps({name: case(*spec, device) for name, spec in json.loads(sys.argv[1]).items()}))
"""


def _run(device: str, env: dict) -> dict:
    result = subprocess.run([sys.executable, "-c", RUN, json.dumps(CASES), device], capture_output=True, text=True,
                            env={**os.environ, **env}, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_ds_mla_kernel_in_the_interpreter_matches_the_reference():
    found = _run("cpu", {"TRITON_INTERPRET": "1"})
    for name, err in found.items():
        assert err["lse"] < 1e-4, (name, err)
        assert err["out"] <= 2 ** -7 * max(1.0, err["out_scale"]), (name, err)   # one bf16 step of the output
        assert err["empty_rows_ok"], (name, err)


@pytest.mark.gpu
def test_ds_mla_kernel_on_the_gpu_matches_the_reference():
    found = _run("cuda", {})
    for name, err in found.items():
        assert err["lse"] < 5e-2, (name, err)      # bf16 products of the dequantised latent
        assert err["out"] <= 2e-2 * max(1.0, err["out_scale"]), (name, err)
        assert err["empty_rows_ok"], (name, err)
