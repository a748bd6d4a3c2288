"""On the GPU: after the pre-build, preparing what the units prepare compiles no Triton kernel (every launch of ours
and of vLLM's Triton kernel is already in Triton's cache), and a second pre-build starts no worker."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from mla_tune.backends.problem import Problem, Shape
from mla_tune.tuner.presets import KeyWork
from mla_tune.tuner.prewarm import prewarm

pytestmark = pytest.mark.gpu

SHAPES = (Shape(1, 1024), Shape(4, 4096), Shape(16, 4096), Shape(64, 8192), Shape(128, 2048))
PROBLEMS = (Problem(num_heads=16), Problem(num_heads=128), Problem(num_heads=64, kv_cache_dtype="fp8_e4m3"),
            Problem(num_heads=16, topk=2048), Problem(num_heads=128, kv_cache_dtype="fp8_e4m3", topk=2048))


def _kernels(cache: Path) -> dict[str, str]:
    """Triton cache entry -> kernel name (each compiled kernel is one folder with its metadata JSON)."""
    out = {}
    for entry in cache.iterdir():
        if entry.is_dir() and entry.name != "mla-tune-builds":
            names = [p.stem for p in entry.glob("*.json") if not p.name.startswith("__grp__")]
            out[entry.name] = names[0] if names else "?"
    return out


def test_units_compile_nothing_after_the_prebuild(tmp_path, monkeypatch):
    import torch

    from mla_tune.backends.inputs import make_inputs
    from mla_tune.backends.interface import BackendUnavailable
    from mla_tune.backends.triton_mla.adapter import TritonMLA, TritonMLASparse
    from mla_tune.backends.vllm_kernels.triton import VllmTritonMLA
    from mla_tune.tuner.probe import probe_devices

    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    device = probe_devices()[0]
    plans = [SimpleNamespace(work=KeyWork(p, SHAPES, (1.0,) * len(SHAPES), tp=None, model="test", value=1.0),
                             backends=("MLA_TUNE_TRITON_SPARSE",) if p.sparse else ("MLA_TUNE_TRITON", "TRITON_MLA"),
                             todo=SHAPES) for p in PROBLEMS]
    kw = dict(gpu=device.uuid, sku=device.sku, fingerprint="gpu-test", cuda_visible=device.uuid)
    first = prewarm(plans, **kw)
    built = _kernels(cache)
    assert built and not [n for n in first.notes if "failed" in n], first.notes

    # What the units do at each shape (`measure._steps` and `_prepare_one`), in this process.
    for plan in plans:
        problem = plan.work.problem
        for shape in SHAPES:
            inputs = make_inputs(problem, shape, device="cuda")
            ours = TritonMLASparse if problem.sparse else TritonMLA
            for _, params in ours().tile_candidates(problem, inputs):
                ours(params=params).prepare(problem, inputs)
            if "TRITON_MLA" in plan.backends:
                try:
                    VllmTritonMLA().prepare(problem, inputs)
                except BackendUnavailable:
                    pass
            torch.cuda.synchronize()
            del inputs
    new = {k: v for k, v in _kernels(cache).items() if k not in built}
    assert not new, f"the units compiled {len(new)} kernel(s) the pre-build did not: {json.dumps(sorted(new.values()))}"

    again = prewarm(plans, **kw)
    assert again.label == "JIT pre-build (every build already on disk)" and again.seconds < 1.0
