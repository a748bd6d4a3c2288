"""The pre-build: it lists what the units will build (our Triton launches exactly as the adapter chooses them,
vLLM's Triton kernel, FlashInfer modules), each distinct build once, runs them in real spawned workers, and a
failed build never fails the tune."""

from __future__ import annotations

import functools
import json
import os
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fake_mla_backends import ADAPTERS, _Prepared
from nvml_fake import FakeNVML, gpu

from mla_tune.backends.device import SoftwareFingerprint
from mla_tune.backends.inputs import ragged_lengths
from mla_tune.backends.interface import DecodeInputs
from mla_tune.backends.nvml_probe import probe_devices
from mla_tune.backends.problem import Problem, Shape
from mla_tune.backends.registry import load_adapter
from mla_tune.backends.vllm_kernels.triton import num_kv_splits
from mla_tune.store.repository import Store
from mla_tune.tuner.presets import KeyWork, TuneSpec
from mla_tune.tuner.prewarm import BuildMarks, prewarm
from mla_tune.tuner.run import TuneOptions, TuneReport, build_plans, tune
from mla_tune.tuner.variants import (
    OUR_TRITON, engine_launch, launch_builds, our_launches, plan_max_seq_len, triton_jobs, unit_lengths, vllm_build)

H100_SMS = 132
FP = SoftwareFingerprint(torch="2.13-test", triton="3.6", kernel_hash="cafe")


class FakeOurs:
    """Stands in for our Triton adapter in a CPU worker: takes a launch, and logs each prepare to a file."""

    name = "MLA_TUNE_TRITON"

    def __init__(self, params=None):
        self.params = params

    def prepare(self, problem, inputs):
        with open(os.environ["MLA_TUNE_TEST_BUILD_LOG"], "a") as log:
            log.write(f"{problem.num_heads} {inputs.q.shape[0]} {self.params.label()}\n")
        return _Prepared(problem)


def _default_plans(tmp_path, *, max_batch: int | None = None):
    """The default tune's plans on a faked H100 (NVML fake), TRITON_MLA added where vLLM is not installed here."""
    (device,) = probe_devices(nvml=FakeNVML([gpu()]))
    with Store.open(f"sqlite:///{tmp_path / 'plan.db'}") as store:
        plans = build_plans(TuneSpec(), store, device, FP, TuneOptions(), TuneReport())
    for plan in plans:
        if not plan.work.problem.sparse and "TRITON_MLA" not in plan.backends:
            plan.backends = (*plan.backends, "TRITON_MLA")
        if max_batch is not None:
            plan.todo = tuple(s for s in plan.todo if s.batch_size <= max_batch)
    return plans


def _light_inputs(problem: Problem, shape: Shape) -> DecodeInputs:
    """What `tile_candidates` reads (batch, lengths, device) without a KV cache."""
    lengths = ragged_lengths(shape, page_size=problem.page_size, min_len=problem.q_len)   # as `make_inputs`
    q = torch.empty((), dtype=torch.bfloat16).expand(shape.batch_size, problem.q_len, problem.num_heads, 576)
    return DecodeInputs(q=q, kv_cache=q, block_table=torch.zeros(shape.batch_size, 1, dtype=torch.int32),
                        seq_lens=torch.tensor(lengths, dtype=torch.int32), sm_scale=0.1)


@pytest.mark.parametrize("max_batch", [pytest.param(4, id="small-batches"),
                                       pytest.param(None, id="every-shape", marks=pytest.mark.slow)])
def test_default_plans_list_every_build_the_units_make_once(tmp_path, monkeypatch, max_batch):
    from mla_tune.backends.triton_mla import adapter as ours

    monkeypatch.setattr(ours, "cc_major", lambda device: 9)
    monkeypatch.setattr(ours, "sm_count", lambda device: H100_SMS)
    plans = _default_plans(tmp_path, max_batch=max_batch)
    assert len(plans) == 16 and all(p.todo for p in plans)
    assert sum("MLA_TUNE_TRITON_FP8Q" in p.backends for p in plans) == 4   # dense FP8 keys, 16-128 heads
    jobs = triton_jobs(plans, num_sms=H100_SMS, cc_major=9)
    covered = [b for job in jobs for b in job.builds]
    assert len(covered) == len(set(covered))                    # no build is in two jobs: nothing built twice
    needed, launches = set(), 0
    for plan in plans:
        problem = plan.work.problem
        for shape in plan.todo:
            for backend in plan.backends:
                if backend in OUR_TRITON:
                    adapter = load_adapter(backend)()
                    chosen = [params for _, params in adapter.tile_candidates(problem, _light_inputs(problem, shape))]
                    # The pre-build's launches are the adapter's, in its order, for every unit.
                    assert our_launches(problem, shape, num_sms=H100_SMS, cc_major=9, seed=0, backend=backend) == chosen
                    for params in chosen:
                        launches += 1
                        needed.update(b for b in launch_builds(problem, params, kv_len=shape.kv_len) if b)
                    # and the launch our vLLM backend makes, where the backend has one
                    engine = engine_launch(problem, shape, backend=backend, num_sms=H100_SMS, cc_major=9,
                                           configured=plan_max_seq_len(plan, None))
                    assert (engine is None) == (backend == "MLA_TUNE_TRITON_FP8Q")
                    needed.update(b for b in (engine[2] if engine else ()) if b)
                elif backend == "TRITON_MLA":
                    # vLLM splits by the longest request, which a batch-1 job of the same length reproduces.
                    assert max(unit_lengths(problem, shape, seed=0)) == shape.kv_len
                    needed.add(vllm_build(problem, shape.kv_len, num_sms=H100_SMS))
    assert needed == set(covered)                               # every build a unit makes, and nothing else
    assert len(jobs) < launches                                 # deduplicated across shapes, heads and dtypes
    kinds = Counter(job.kind for job in jobs)
    assert kinds["hopper"] and kinds["tl"] and kinds["vllm"]
    # A job kept for its combine comes after every stage-1 job, whose builds include its stage 1.
    order = [job.kind for job in jobs]
    assert order == sorted(order, key=["hopper", "tl", "vllm", "combine"].index)
    stage1 = {b for job in jobs if job.kind != "combine" for b in job.builds if b[0] == "stage1"}
    for job in jobs:
        if job.kind == "combine" and not job.engine:   # an engine job's builds: the binder test below
            assert launch_builds(job.problem, job.params, kv_len=job.shape.kv_len)[0] in stage1
    for job in jobs:                    # a job builds at batch 1 with the unit's length; an engine job at its batch
        assert job.shape.batch_size == 1 or job.engine


def test_vllm_builds_follow_its_split_rule():
    problem = Problem(num_heads=16)
    assert vllm_build(problem, 4096, num_sms=H100_SMS)[5] == num_kv_splits(4096, H100_SMS) == 8
    assert vllm_build(problem, 4096, num_sms=H100_SMS) != vllm_build(problem, 8192, num_sms=H100_SMS)


def _plans(problem: Problem, backends: tuple[str, ...], shapes: tuple[Shape, ...]):
    work = KeyWork(problem, shapes, (1.0,) * len(shapes), tp=None, model="custom", value=1.0)
    return [SimpleNamespace(work=work, backends=backends, todo=shapes)]


def test_worker_reports_its_gpu_and_the_pool_builds_each_launch_once_then_nothing(tmp_path, monkeypatch):
    log = tmp_path / "builds.log"
    monkeypatch.setenv("MLA_TUNE_TEST_BUILD_LOG", str(log))
    problem = Problem(num_heads=16)
    shapes = (Shape(1, 100), Shape(3, 200), Shape(2, 700))
    plans = _plans(problem, ("MLA_TUNE_TRITON", "FAKE_GOOD"), shapes)
    marks = BuildMarks(fingerprint=FP.digest, sku="Fake H100", folder=tmp_path / "marks")
    kw = dict(gpu="GPU-fake-0", sku="Fake H100", fingerprint=FP.digest, worker_device="cpu", marks=marks,
              adapters=(("MLA_TUNE_TRITON", "test_prewarm:FakeOurs"), ("FAKE_GOOD", ADAPTERS["FAKE_GOOD"])),
              prefixes=("FAKE_",), max_workers=1)
    first = prewarm(plans, **kw)
    # The CPU worker reports the interpreter's 4 SMs and no compute capability; the launches follow from them.
    expected = [f"16 1 {job.params.label()}" for job in triton_jobs(plans, num_sms=4, cc_major=None,
                                                                     adapters=kw["adapters"])]
    assert sorted(log.read_text().splitlines()) == sorted(expected) and expected
    assert first.label == f"JIT pre-build ({len(expected) + 1} builds, 1 workers)"
    assert first.notes[0].startswith(f"JIT pre-build: {len(expected) + 1} build(s) (1 JIT libraries, ")
    assert marks.device_facts("GPU-fake-0") == {"num_sms": 4, "cc_major": None}
    again = prewarm(plans, **kw)
    assert again.label == "JIT pre-build (every build already on disk)" and again.notes == []
    assert again.seconds < 1.0 and len(log.read_text().splitlines()) == len(expected)
    # A new shape: the SM count is known, only its new builds run, the others stay marked.
    more = _plans(problem, ("MLA_TUNE_TRITON",), (*shapes, Shape(1, 4000)))
    prewarm(more, **kw)
    new = {f"16 1 {job.params.label()}" for job in triton_jobs(more, num_sms=4, cc_major=None,
                                                                adapters=kw["adapters"])} - set(expected)
    assert new and sorted(log.read_text().splitlines()) == sorted(expected + list(new))
    # A plan never seen whose builds are all marked: listed in this process, no worker started.
    fewer = prewarm(_plans(problem, ("MLA_TUNE_TRITON", "FAKE_GOOD"), shapes[:2]), **kw)
    assert fewer.label == "JIT pre-build (every build already on disk)" and fewer.notes == []
    assert len(log.read_text().splitlines()) == len(expected) + len(new)


def test_a_mark_holds_only_while_the_libraries_it_relied_on_exist(tmp_path):
    library = tmp_path / "fa3.so"
    library.write_bytes(b"")
    marks = BuildMarks(fingerprint="f", sku="s", folder=tmp_path / "marks")
    marks.mark(("build", 1), evidence=[str(library)])
    assert marks.done(("build", 1)) and not marks.done(("build", 2))
    assert not BuildMarks(fingerprint="other", sku="s", folder=tmp_path / "marks").done(("build", 1))
    library.unlink()
    assert not marks.done(("build", 1))


def test_a_failed_build_does_not_fail_the_tune(tmp_path, monkeypatch):
    monkeypatch.setenv("MLA_TUNE_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("MLA_TUNE_FAKE_MS", json.dumps({"FAKE_GOOD": 1.0}))
    from mla_tune.backends.device import DeviceInfo
    from mla_tune.tuner.presets import load_workload

    workload = tmp_path / "shapes.json"
    workload.write_text(json.dumps({"shapes": [{"batch_size": 1, "kv_len": 100}]}))
    spec = TuneSpec(models=("custom:512/64/128/128:heads=8",), tps=(8,), kv_cache_dtypes=("bf16",),
                    workload=load_workload(workload))
    options = TuneOptions(worker_device="cpu", adapters={n: ADAPTERS[n] for n in ("FAKE_GOOD", "FAKE_RAISE")},
                          bench="fake_mla_backends:fake_bench", fingerprint=FP, progress=False, max_seconds=0.1,
                          jit_prefixes=("FAKE_",))
    device = DeviceInfo("Fake H100", (9, 0), uuid="GPU-fake-0", index=0, memory_total_mib=81559)
    with Store.open(f"sqlite:///{tmp_path / 'tune.db'}") as store:
        report = tune(spec, store=store, devices=[device], options=options)
        (decision,) = store.decisions()
    assert decision.winner == "FAKE_GOOD" and decision.failures["FAKE_RAISE"].startswith("failed")
    assert [name for name in report.seconds if name.startswith("JIT pre-build")] == [
        f"JIT pre-build (1 builds, {min(2, os.cpu_count())} workers)"]
    assert any(n.startswith("JIT pre-build of FAKE_RAISE (bf16 KV, 1 heads): failed: prepare or first run raised "
                            "RuntimeError: fake library cannot plan this problem") for n in report.notes), report.notes
    # The build that worked is marked in Triton's cache folder; the plan is not, so the next tune tries again.
    assert len(list(Path(tmp_path / "triton" / "mla-tune-builds").iterdir())) == 1


@functools.cache
def _binder(kernel):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    return create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))


def _triton_identity(kernel, args, kwargs) -> tuple:
    """Triton's own in-memory key of a launch (its binder's specialization and options) for sm_90, no GPU needed."""
    _, specialization, options = _binder(kernel)(*args, **kwargs)
    return kernel.fn.__name__, repr(specialization), str(options)


def test_builds_agree_with_tritons_own_specialization(monkeypatch):
    """Launches of the tl kernel (the CPU runs no Hopper kernel) and the combine, recorded from the real launcher:
    two launches share a build here exactly when Triton's binder gives them one key, and a job's batch-1 launch
    has the key of the unit launch it stands for."""
    from mla_tune.backends.inputs import make_inputs
    from mla_tune.backends.triton_mla import combine, launcher, tl_kernel
    from mla_tune.backends.triton_mla.adapter import PreparedTritonMLA

    recorded = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: recorded.append(_triton_identity(self.kernel, args, kwargs))

    monkeypatch.setattr(launcher, "_mla_split_kernel", Recorder(tl_kernel._mla_split_kernel))
    monkeypatch.setattr(launcher, "_mla_combine_kernel", Recorder(combine._mla_combine_kernel))

    def keys(problem, shape, params):
        recorded.clear()
        inputs = make_inputs(problem, shape)
        PreparedTritonMLA(problem, inputs, params).run(inputs)
        return list(recorded)

    problems = (Problem(num_heads=16), Problem(num_heads=64, kv_cache_dtype="fp8_e4m3"), Problem(num_heads=128),
                Problem(num_heads=8), Problem(num_heads=32, topk=256), Problem(num_heads=16, q_len=2))
    shapes = (Shape(1, 64), Shape(3, 700), Shape(8, 2048), Shape(2, 4096), Shape(1, 1000))
    ours, theirs, launches = {}, {}, 0
    for problem in problems:
        for shape in shapes:
            for params in our_launches(problem, shape, num_sms=132, cc_major=None, seed=0):
                launches += 1
                unit = keys(problem, shape, params)
                assert keys(problem, Shape(1, shape.kv_len), params) == unit   # the job builds what the unit does
                builds = [b for b in launch_builds(problem, params, kv_len=shape.kv_len) if b is not None]
                assert len(builds) == len(unit)
                for build, key in zip(builds, unit):
                    ours.setdefault(build, set()).add(key)
                    theirs.setdefault(key, set()).add(build)
    assert all(len(v) == 1 for v in ours.values())      # never two Triton builds under one of ours
    assert all(len(v) == 1 for v in theirs.values())    # never one Triton build under two of ours
    assert len([b for b in ours if b[0] == "stage1"]) < launches    # and launches do share builds


@pytest.mark.parametrize("heads", [16, 20, 64])
def test_a_stage1_build_has_the_constexprs_the_launcher_gives_its_launch(monkeypatch, heads):
    # the wide FP8-query form's p @ v rows follow the launch's packed rows: the pre-build must compile the same variant
    from mla_tune.backends.triton_mla import dispatch, hopper, launcher
    from mla_tune.backends.triton_mla.config import LaunchParams

    seen = []

    class RecordingKernel:  # stands in for the Gluon kernel (no GPU here)
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(kw)

    monkeypatch.setattr(hopper, "_mla_hopper_kernel", RecordingKernel())
    monkeypatch.setattr(dispatch, "FP8Q_TMA", False)  # no TMA descriptors over a CPU tensor
    problem = Problem(num_heads=heads, kv_cache_dtype="fp8_e4m3", page_size=64)
    params = LaunchParams(**dispatch.fp8_query_form_tile("wide", heads).launch_fields(), num_splits=1,
                          split_items=4096)
    cuda_q = type("CudaTensor", (), {"is_cuda": True, "shape": (2, 1, heads, 576)})()
    kv = torch.empty(2, 64, 576, dtype=torch.float8_e4m3fn)
    launcher._launch_hopper((), (1, 2, 1), {"SPARSE": False, "Q_LEN": 1}, q=cuda_q, kv_cache=kv, params=params,
                            tiles=4096 // params.block_n)
    form = dict(launch_builds(problem, params, kv_len=4096)[0][9])
    assert form.pop("TMA") is ("kv_lat_desc" in seen[0])   # the build knows whether the launch passes descriptors
    assert form == {name: seen[0][name] for name in form}
    assert form["PV_ROWS"] == {16: 16, 20: 32, 64: 64}[heads]


def _unit_inputs(problem: Problem, shape: Shape) -> DecodeInputs:
    """A unit's inputs as `make_inputs` lays them out (same lengths, block table, top-k), the caches left unfilled:
    what a launch's Triton key depends on, at any batch, on a CPU."""
    from mla_tune.backends.inputs import random_topk_indices, scattered_block_table

    lengths = ragged_lengths(shape, page_size=problem.page_size, min_len=problem.q_len)
    table, pages = scattered_block_table(lengths, page_size=problem.page_size)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    fp8 = problem.kv_cache_dtype in ("fp8_e4m3", "fp8_ds_mla")   # fp8_ds_mla: an e4m3 cache, packed at prepare
    topk = random_topk_indices(seq_lens, q_len=problem.q_len, topk=problem.topk,
                               generator=torch.Generator().manual_seed(0)) if problem.sparse else None
    q = torch.empty(shape.batch_size, problem.q_len, problem.num_heads, 576, dtype=torch.bfloat16)
    kv = torch.empty(pages, problem.page_size, 576, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    return DecodeInputs(q=q, kv_cache=kv, block_table=torch.tensor(table, dtype=torch.int32), seq_lens=seq_lens,
                        sm_scale=0.1, kv_scale=0.02 if fp8 else None, topk_indices=topk)


@pytest.fixture
def recorded_keys(monkeypatch):
    """On a faked H100: our kernels' launches (stage 1 on the tl or the Hopper kernel, the combine, the query
    rounding) record Triton's own key (its binder's specialization and options) into the returned list instead of
    running."""
    from mla_tune.backends.triton_mla import adapter, decode, hopper, launcher, query_e4m3

    for module in (adapter, decode, launcher):
        monkeypatch.setattr(module, "cc_major", lambda device: 9)
        monkeypatch.setattr(module, "sm_count", lambda device: H100_SMS)
    monkeypatch.setattr(query_e4m3, "cc_major", lambda device: 9)
    keys = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: keys.append(_triton_identity(self.kernel, args, kwargs))

        def warmup(self, *args, grid, **kwargs):
            keys.append(_triton_identity(self.kernel, args, kwargs))

    for module, name in ((launcher, "_mla_split_kernel"), (launcher, "_mla_combine_kernel"),
                         (hopper, "_mla_hopper_kernel"), (query_e4m3, "_round_query_kernel")):
        monkeypatch.setattr(module, name, Recorder(getattr(module, name)))
    launch_hopper = launcher._launch_hopper

    def hopper_on_cpu(*args, q, **kwargs):   # Gluon has no interpreter: the binder alone takes the launch
        return launch_hopper(*args, q=q.as_subclass(_CudaLooking), **kwargs)

    monkeypatch.setattr(launcher, "_launch_hopper", hopper_on_cpu)
    return keys


def _assert_units_launch_only_prebuilt_keys(plans, keys: list, *, engine_max_seq_len: int | None = None) -> None:
    """Every Triton key the units of `plans` launch (each candidate tile and the launch our vLLM backend makes, as
    `measure._steps` lists them) is one a pre-build job launched through `build_in_worker`, and no stage-1 build is
    made by two jobs."""
    from mla_tune.tuner.measure import ShapeTask, _steps
    from mla_tune.tuner.prewarm import build_in_worker

    unit_keys = set()
    for plan in plans:
        problem = plan.work.problem
        for shape in plan.todo:
            task = ShapeTask(problem, shape, tuple(b for b in plan.backends if b in OUR_TRITON),
                             engine_max_seq_len=plan_max_seq_len(plan, engine_max_seq_len))
            inputs = _unit_inputs(problem, shape)
            steps = _steps(task, problem, inputs, {}, emit=lambda event: pytest.fail(f"{event}"))
            assert any(step.engine for step in steps) == bool({"MLA_TUNE_TRITON", "MLA_TUNE_TRITON_SPARSE"}
                                                             & set(plan.backends))
            for step in steps:
                step.adapter.prepare(problem, inputs)
            unit_keys.update(keys)
            keys.clear()
    job_keys, stage1_jobs = set(), Counter()
    for job in triton_jobs(plans, num_sms=H100_SMS, cc_major=9, engine_max_seq_len=engine_max_seq_len):
        if job.kind == "vllm":
            continue
        events = []
        build_in_worker(job, events.append, device="cpu")
        assert events[1][2].status == "ok", (job.label(), events[1])
        if job.kind != "combine":   # a combine job runs a stage 1 built before it
            stage1_jobs.update({key for key in keys if key[0] in ("_mla_split_kernel", "_mla_hopper_kernel")})
        job_keys.update(keys)
        keys.clear()
    assert unit_keys and unit_keys <= job_keys, sorted(unit_keys - job_keys)[:3]
    assert max(stage1_jobs.values()) == 1


@pytest.mark.parametrize("max_batch", [pytest.param(4, id="small-batches"),
                                       pytest.param(None, id="every-shape", marks=pytest.mark.slow)])
def test_the_default_tunes_units_launch_nothing_the_prebuild_did_not_build(tmp_path, recorded_keys, max_batch):
    _assert_units_launch_only_prebuilt_keys(_default_plans(tmp_path, max_batch=max_batch), recorded_keys)


def test_units_with_several_query_tokens_and_a_configured_max_seq_len_launch_only_prebuilt_keys(recorded_keys):
    # MTP query lengths (6 is above what one launch of our vLLM backend takes: its tokens become requests), odd head
    # counts, a sparse problem of two query tokens, fp8_ds_mla rows, and vLLM's max_seq_len given by the operator
    shapes = (Shape(1, 1000), Shape(3, 700), Shape(16, 2048))
    plans = [plan for problem, backends in (
        (Problem(num_heads=16, kv_cache_dtype="fp8_e4m3", q_len=2), ("MLA_TUNE_TRITON", "MLA_TUNE_TRITON_FP8Q")),
        (Problem(num_heads=20, q_len=6), ("MLA_TUNE_TRITON",)),
        (Problem(num_heads=3, kv_cache_dtype="fp8_e4m3"), ("MLA_TUNE_TRITON",)),
        (Problem(num_heads=32, topk=256, q_len=2), ("MLA_TUNE_TRITON_SPARSE",)),
        (Problem(num_heads=64, kv_cache_dtype="fp8_ds_mla", topk=512), ("MLA_TUNE_TRITON_SPARSE",)),
    ) for plan in _plans(problem, backends, shapes)]
    _assert_units_launch_only_prebuilt_keys(plans, recorded_keys, engine_max_seq_len=4096)


class _CudaLooking(torch.Tensor):
    """A CPU tensor that passes the Hopper launcher's device check (its arguments go to Triton's binder only)."""

    @property
    def is_cuda(self):
        return True
