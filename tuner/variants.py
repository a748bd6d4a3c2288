"""The kernel builds a tune will need, found before any unit runs, one job per distinct build.

A JIT library or a Triton kernel is built the first time a unit prepares it, and the units run one after the
other, so on a fresh machine their builds add up. This module lists what the units will build, so that
`prewarm.py` can build it all at once in parallel workers:

- FlashInfer: one module per (backend, dtypes, geometry, page size, top-k, q_len);
- our Triton kernel: every candidate launch a unit will time (`TritonMLA.tile_candidates`: the same tiles and
  the same split model, from the device's SM count and compute capability); a launch is one stage-1 compile and,
  with several splits, one combine compile;
- our kernel as our vLLM backend launches it (the step timed beside the candidate tiles): the launch
  `vllm_backends.launch` makes for the unit's batch and vLLM's max_seq_len;
- vLLM's Triton MLA kernel: one compile per (heads, dtypes, page size, split count).

Builds are told apart by what Triton compiles a kernel for: its constexprs, its launch options and, for each
integer argument, whether it is 1 or a multiple of 16 (Triton specialises on both). Two units whose launches
agree on all of that share one build, whatever their batch and lengths; a job builds it at batch 1 with the
unit's longest length, which gives the same block-table stride and the same split count.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mla_tune.backends.problem import Problem, Shape

# Backends whose first prepare compiles for tens of seconds (a JIT library per module).
JIT_PREFIXES = ("FLASHINFER",)
OUR_TRITON = ("MLA_TUNE_TRITON", "MLA_TUNE_TRITON_SPARSE", "MLA_TUNE_TRITON_FP8Q")
VLLM_TRITON = "TRITON_MLA"
# The tokens an engine job's requests hold: its build depends on the batch and vLLM's max_seq_len only.
ENGINE_JOB_KV_LEN = 256
# Build order, longest first, so the longest builds start at once: FlashInfer modules (25-40 s), the
# warp-specialised Hopper kernel, the tl kernel, vLLM's kernel, then launches kept only for their combine.
_RANK = {"jit": 0, "hopper": 1, "tl": 2, "vllm": 3, "combine": 4}
KIND_LABELS = {"jit": "JIT libraries", "hopper": "Hopper kernels", "tl": "tl kernels",
               "vllm": "vLLM Triton kernels", "combine": "combine kernels"}


@dataclass(frozen=True)
class CompileJob:
    """One build: `backends[0]` prepared and run once at `shape` (untimed, ungated), sent to a worker like a
    `ShapeTask`.

    Attributes:
        backends: the one backend to prepare (a tuple, as `Worker.run_shape` expects).
        problem: the key's problem.
        shape: a small shape that makes the same build as the units' (batch 1; an engine job: the unit's batch).
        params: our Triton kernel's launch (`LaunchParams`) a unit will time; None: the adapter's own choice.
        engine: prepare the backend's launch as our vLLM backend makes it (`vllm_launch`) with `max_seq_len`.
        builds: the build identities this job covers (`launch_builds`); the first is its own.
        kind: jit (a JIT library), hopper, tl, vllm or combine (`KIND_LABELS`; the queue order).
        adapters: name -> "module:Class" overrides (tests).
        max_seconds: unused (no timing); `Worker` reads it.
    """

    backends: tuple[str, ...]
    problem: Problem
    shape: Shape
    params: object | None = None
    builds: tuple = ()
    kind: str = "jit"
    adapters: tuple[tuple[str, str], ...] = ()
    max_seconds: float = 0.0
    engine: bool = False
    max_seq_len: int | None = None

    @property
    def backend(self) -> str:
        return self.backends[0]

    @property
    def rank(self) -> int:
        return _RANK[self.kind]

    def label(self) -> str:
        """E.g. `MLA_TUNE_TRITON h64n64w8s2Wx4 (fp8_e4m3 KV, 64 heads)`."""
        what = f" {self.params.label()}" if self.params is not None else ""
        if self.engine:
            what = f" as our vLLM backend launches it at batch {self.shape.batch_size}"
        return f"{self.backend}{what} ({self.problem.kv_cache_dtype} KV, {self.problem.num_heads} heads)"


def int_spec(value: int) -> tuple[bool, bool]:
    """What Triton specialises an integer argument on: equal to 1, a multiple of 16."""
    return value == 1, value % 16 == 0


def _specs(*values: int) -> tuple:
    return tuple(int_spec(int(v)) for v in values)


def block_table_pages(problem: Problem, kv_len: int) -> int:
    """The block table's row stride: pages of the longest request (`inputs.scattered_block_table`)."""
    return -(-kv_len // problem.page_size)


def launch_builds(problem: Problem, params, *, kv_len: int, table_stride: int | None = None,
                  kv_scale_is_ptr: bool = False) -> tuple[tuple, tuple | None]:
    """(stage-1 build, combine build or None) of one launch of our kernel (`launcher.launch`'s arguments) whose
    block table is as wide as `kv_len` tokens; `table_stride`: its row stride where that is not its width (0: one
    row read by every request, our vLLM backend's sparse launch); `kv_scale_is_ptr`: the FP8 scale is a tensor (our
    vLLM backends pass vLLM's k_scale), not a float."""
    from mla_tune.backends.triton_mla.config import LAUNCH_FIELDS
    from mla_tune.backends.triton_mla.dispatch import COMBINE_SPLITS_AT_ONCE, copies_by_tma, hopper_constexprs
    from mla_tune.backends.triton_mla.launcher import split_extent

    heads, q_len, head = problem.num_heads, problem.q_len, problem.geometry.head_size
    latent, splits, topk = problem.geometry.kv_lora_rank, params.num_splits, problem.topk or 0
    pages = block_table_pages(problem, kv_len)
    split_items, tiles = split_extent(params, capacity=topk if problem.sparse else pages * problem.page_size)
    rows = q_len * heads
    if splits > 1:
        o_strides = (splits * rows * latent, rows * latent, heads * latent, latent)
        l_strides = (splits * rows, rows, heads, 1)
    else:
        o_strides, l_strides = (rows * latent, 0, heads * latent, latent), (rows, 0, heads, 1)
    ints = _specs(heads, topk, q_len * topk, split_items, rows * head, heads * head, head, problem.page_size * head,
                  pages if table_stride is None else table_stride, *o_strides, *l_strides)
    fixed = tuple((name, getattr(params, name)) for name in LAUNCH_FIELDS if name not in ("num_splits", "split_items"))
    form = None
    if params.warp_specialized:
        fp8 = problem.kv_cache_dtype in ("fp8_e4m3", "fp8_ds_mla")
        form = tuple(sorted(hopper_constexprs(params, kv_fp8=problem.kv_cache_dtype == "fp8_e4m3",
                                              sparse=problem.sparse, tiles=tiles,
                                              ds_mla=problem.kv_cache_dtype == "fp8_ds_mla",
                                              query_rows=rows).items()))
        # whether the launch passes the cache's TMA descriptors, as it does over the tuner's contiguous caches
        form += (("TMA", copies_by_tma(params, kv_fp8=fp8, sparse=problem.sparse, page_size=problem.page_size,
                                       query_rows=rows)),)
    # With several splits stage 1 writes float32 partials, with one the output in the query's dtype.
    stage1 = ("stage1", problem.kv_cache_dtype, problem.query_dtype, q_len, problem.page_size, problem.sparse,
              splits > 1, kv_scale_is_ptr, fixed, form, ints)
    if splits == 1:
        return stage1, None
    block_s = 1 << (splits - 1).bit_length()
    combine = ("combine", problem.query_dtype, block_s, min(block_s, COMBINE_SPLITS_AT_ONCE), params.longest_first,
               _specs(heads, splits, *o_strides, *l_strides, rows * latent, heads * latent, rows, heads,
                      split_items if params.longest_first else 0))
    return stage1, combine


def unit_lengths(problem: Problem, shape: Shape, *, seed: int) -> list[int]:
    """What our adapter chooses splits from for the inputs a unit makes (`adapter.unit_lengths`)."""
    from mla_tune.backends.inputs import ragged_lengths
    from mla_tune.backends.triton_mla.adapter import unit_lengths as adapter_lengths

    return adapter_lengths(problem, ragged_lengths(shape, page_size=problem.page_size, min_len=problem.q_len,
                                                   seed=seed))


def our_launches(problem: Problem, shape: Shape, *, num_sms: int, cc_major: int | None, seed: int,
                 backend: str = "MLA_TUNE_TRITON") -> list:
    """The launches a unit times for our kernel `backend` at `shape` (`adapter.candidate_launches`, without
    inputs)."""
    from mla_tune.backends.registry import load_adapter
    from mla_tune.backends.triton_mla.adapter import candidate_launches

    lengths = unit_lengths(problem, shape, seed=seed)
    return [params for _, params in candidate_launches(problem, lengths=lengths, num_sms=num_sms, cc_major=cc_major,
                                                       fp8_query=load_adapter(backend).fp8_query)]


def plan_max_seq_len(plan, configured: int | None) -> int:
    """vLLM's max_seq_len a key's engine steps are timed with (`ShapeTask.engine_max_seq_len`): the operator's, or
    the longest kv_len the key is timed at."""
    return configured or max(shape.kv_len for shape in plan.work.shapes)


def engine_launch(problem: Problem, shape: Shape, *, backend: str, num_sms: int, cc_major: int | None,
                  configured: int | None, adapters: tuple[tuple[str, str], ...] = ()
                  ) -> tuple[int | None, object, tuple[tuple, tuple | None]] | None:
    """(vLLM's max_seq_len, `LaunchParams`, `launch_builds`) of a unit's engine step: our kernel `backend` as our
    vLLM backend launches it; None where `backend`'s adapter has no vLLM backend."""
    from mla_tune.tuner.measure import engine_seq_len, resolve_adapter
    from mla_tune.vllm_backends.launch import kernel_launch

    if getattr(resolve_adapter(backend, dict(adapters)), "vllm_launch", None) is None:
        return None
    max_seq_len = engine_seq_len(problem, shape, configured)
    kernel = kernel_launch(problem, shape.batch_size, max_seq_len=max_seq_len, num_sms=num_sms, cc_major=cc_major)
    return max_seq_len, kernel.params, launch_builds(kernel.problem, kernel.params, kv_len=max_seq_len or shape.kv_len,
                                                     table_stride=kernel.table_stride,
                                                     kv_scale_is_ptr=kernel.kv_scale_is_ptr)


def vllm_build(problem: Problem, kv_len: int, *, num_sms: int) -> tuple:
    """The build of vLLM's Triton MLA kernel for a unit whose longest request is `kv_len` tokens."""
    from mla_tune.backends.vllm_kernels.triton import num_kv_splits

    heads, head, latent = problem.num_heads, problem.geometry.head_size, problem.geometry.kv_lora_rank
    splits = num_kv_splits(kv_len, num_sms)
    return ("vllm", problem.kv_cache_dtype, problem.query_dtype, heads, problem.page_size, splits,
            _specs(block_table_pages(problem, kv_len), heads * head, head, problem.page_size * head,
                   heads * splits * (latent + 1), splits * (latent + 1), heads * latent, heads))


def _units(plans: Sequence) -> Iterable[tuple[Problem, tuple[str, ...], Shape]]:
    for plan in plans:
        for shape in plan.todo:
            yield plan.work.problem, plan.backends, shape


def jit_jobs(plans: Sequence, *, prefixes: Sequence[str] = JIT_PREFIXES,
             adapters: tuple[tuple[str, str], ...] = ()) -> list[CompileJob]:
    """One job per (JIT backend, dtypes, geometry, page size, top-k, q_len) the plans time."""
    seen, jobs = set(), []
    for plan in plans:
        p = plan.work.problem
        for backend in plan.backends if plan.todo else ():
            ident = (backend, p.kv_cache_dtype, p.query_dtype, p.geometry, p.page_size, p.topk, p.q_len)
            if not backend.startswith(tuple(prefixes)) or ident in seen:
                continue
            seen.add(ident)
            jobs.append(CompileJob((backend,), p, Shape(1, max(2 * p.page_size, p.q_len + 1)), builds=(ident,),
                                   adapters=adapters))
    return jobs


def triton_jobs(plans: Sequence, *, num_sms: int, cc_major: int | None, seed: int = 0,
                adapters: tuple[tuple[str, str], ...] = (),
                engine_max_seq_len: int | None = None) -> list[CompileJob]:
    """One job per distinct Triton build of the plans' units (ours, ours as our vLLM backend launches it with
    `engine_max_seq_len` (`TuneOptions`), vLLM's), longest first.

    A launch of our kernel gets a job when its stage-1 build is new; one whose stage 1 is already covered but
    whose combine is new gets a job of kind `combine`, queued last (by then its stage 1 is in the cache). The
    engine launches come after every candidate's, so that a combine both make is built with both its variants.
    """
    seen: set = set()
    jobs: list[CompileJob] = []

    def add(builds: tuple, launch, **job) -> None:
        new = [b for b in builds if b is not None and b not in seen]
        if new:
            seen.update(new)
            kind = ("hopper" if launch.warp_specialized else "tl") if builds[0] in new else "combine"
            jobs.append(CompileJob(builds=tuple(new), kind=kind, adapters=adapters, **job))

    for problem, backends, shape in _units(plans):
        for backend in backends:
            if backend in OUR_TRITON:
                for params in our_launches(problem, shape, num_sms=num_sms, cc_major=cc_major, seed=seed,
                                           backend=backend):
                    add(launch_builds(problem, params, kv_len=shape.kv_len), params, backends=(backend,),
                        problem=problem, shape=Shape(1, shape.kv_len), params=params)
            elif backend == VLLM_TRITON:
                build = vllm_build(problem, shape.kv_len, num_sms=num_sms)
                if build not in seen:
                    seen.add(build)
                    jobs.append(CompileJob((backend,), problem, Shape(1, shape.kv_len), builds=(build,),
                                           kind="vllm", adapters=adapters))
    for plan in plans:
        configured = plan_max_seq_len(plan, engine_max_seq_len)
        for shape in plan.todo:
            for backend in plan.backends:
                engine = engine_launch(plan.work.problem, shape, backend=backend, num_sms=num_sms, cc_major=cc_major,
                                       configured=configured, adapters=adapters) if backend in OUR_TRITON else None
                if engine is not None:
                    # the launch does not depend on the lengths (vLLM's table is as wide as max_seq_len): few tokens
                    max_seq_len, params, builds = engine
                    add(builds, params, backends=(backend,), problem=plan.work.problem, engine=True,
                        shape=Shape(shape.batch_size, min(shape.kv_len, ENGINE_JOB_KV_LEN)), max_seq_len=max_seq_len)
    return sorted(jobs, key=lambda job: job.rank)
