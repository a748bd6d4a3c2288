"""The runtime lookup a serving engine calls at startup: which MLA backend to use.

`lookup` returns the stored (tuned) decision for this GPU's SKU and key when
one was measured with compatible software, else vLLM's static choice, and
says which and why. The static choice is the one vLLM makes on this GPU
with its kernels installed: the packages of the process calling `lookup`
(an init container, a CLI environment) are not the engine's, so they are not
checked. It never imports torch, triton or flashinfer, never
writes or migrates the store, never raises because of the store, and is
memoised per process.
"""

from __future__ import annotations

import threading
import types
from dataclasses import dataclass, field

from mla_tune.backends.device import DeviceInfo
from mla_tune.backends.priority import static_choice
from mla_tune.backends.problem import DeviceSpec, Geometry, Problem, parse_compute_capability
from mla_tune.backends.registry import BACKENDS, backend_reasons, candidates

DEFAULT_SPARSE_TOPK = 2048    # DeepSeek-V3.2 and GLM-5 index top-k


class NoDeviceError(ValueError):
    """`lookup` was called without `device` on a machine where no NVIDIA GPU can be probed.

    Attributes:
        detail: the probe's own one-line message (e.g. NVML could not start).
    """

    def __init__(self, detail: str):
        self.detail = detail
        super().__init__(f"{detail}; pass device={{'name': ..., 'compute_capability': (major, minor)}} "
                         f"to look up a decision without a local GPU")


class NoEligibleBackendError(ValueError):
    """Nothing is tuned for the key and no backend in vLLM's priority list can run it."""


@dataclass(frozen=True)
class Choice:
    """The backend to use for one key, and why.

    Attributes:
        backend: canonical backend name, e.g. "FLASHINFER_FA3_MLA".
        source: "tuned" (a stored decision) or "fallback" (vLLM's static choice).
        reasons: {backend: (sentence, ...)} for every candidate backend not chosen.
        why: one sentence on why this source was used (e.g. no tuned decision).
        key: the decision key (`DecisionKey.to_dict()` form).
        static_choice: what vLLM's static priority picks for this key.
        runner_up: second-best backend of a tuned decision.
        margin: runner-up score / winner score - 1 (tuned only).
        decided_at: when the tuned decision was made (ISO 8601, UTC).
        scores: {backend: score} of a tuned decision (1.0 = best at every shape); empty for a fallback.
        warnings: store problems met on the way (already logged once).
        engine_best: {engine: the fastest backend that engine runs under its own name} of a tuned
            decision; None for a fallback, or for a decision that never timed the engines' own kernels.
        plugin_scores: {backend: score of the launch our vLLM backend makes of it} of a tuned decision; None
            for a fallback, or for a decision that never timed that launch.
    """

    backend: str
    source: str
    reasons: types.MappingProxyType = field(default_factory=lambda: types.MappingProxyType({}))
    why: str = ""
    key: types.MappingProxyType = field(default_factory=lambda: types.MappingProxyType({}))
    static_choice: str | None = None
    runner_up: str | None = None
    margin: float | None = None
    decided_at: str = ""
    scores: types.MappingProxyType = field(default_factory=lambda: types.MappingProxyType({}))
    warnings: tuple[str, ...] = ()
    engine_best: types.MappingProxyType | None = None
    plugin_scores: types.MappingProxyType | None = None

    def to_dict(self) -> dict:
        """Plain JSON-ready values (reasons as lists)."""
        return {"backend": self.backend, "source": self.source,
                "reasons": {name: list(texts) for name, texts in self.reasons.items()},
                "why": self.why, "key": dict(self.key), "static_choice": self.static_choice,
                "runner_up": self.runner_up, "margin": self.margin, "decided_at": self.decided_at,
                "scores": dict(self.scores), "warnings": list(self.warnings),
                "engine_best": None if self.engine_best is None else dict(self.engine_best),
                "plugin_scores": None if self.plugin_scores is None else dict(self.plugin_scores)}


_MEMO: dict = {}
_WARNED: set[str] = set()
_LOCK = threading.Lock()


def clear_cache() -> None:
    """Forget memoised answers and probed devices (tests, or after a new tune in this process)."""
    with _LOCK:
        _MEMO.clear()
        _WARNED.clear()
    _probe_local.cache_clear()


def _freeze(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def lookup(num_heads, kv_cache_dtype, *, device=None, sparse=False, db=None, page_size=64,
           query_dtype="bf16", topk=None, geometry=None, q_len=1) -> Choice:
    """The backend to use for an MLA decode problem on a GPU.

    Args:
        num_heads: query heads per rank (model heads / TP), a positive int.
        kv_cache_dtype: any vLLM `--kv-cache-dtype` spelling (`auto`, `fp8`, ...) or `bf16`/`fp16`.
        device: `{"name": "NVIDIA H100 80GB HBM3", "compute_capability": (9, 0)}`
            (optionally `memory_total_mib`, `pci_device_id`, `mig_profile`,
            `driver_version` to pin the SKU), a `DeviceInfo`, or None to
            probe the GPU this process would use through NVML.
        sparse: a sparse (top-k) model such as DeepSeek-V3.2.
        db: SQLAlchemy URL of the store; None = `$MLA_TUNE_DB` or the default file.
        page_size: KV-cache tokens per page.
        query_dtype: the model dtype, `bf16` or `fp16`.
        topk: sparse top-k (default 2048 when `sparse`; giving it implies `sparse`).
        geometry: a `Geometry` (default DeepSeek 512/64/128/128).
        q_len: query tokens per request (2 with MTP).

    Returns:
        A `Choice`; the same object for the same arguments within a process.

    Raises:
        ValueError: invalid arguments (heads <= 0 or not an int, unknown dtype,
            bad compute capability).
        NoDeviceError (a ValueError): `device` is None and no GPU can be
            probed; pass `device` explicitly on such machines.
        NoEligibleBackendError (a ValueError): nothing is tuned and no backend
            of vLLM's priority list can run the problem on the device (the
            message lists each one's reasons).
    """
    memo_key = ("lookup", type(num_heads), num_heads, kv_cache_dtype, _freeze(device), sparse, db, page_size,
                query_dtype, topk, geometry if not isinstance(geometry, dict) else _freeze(geometry), q_len)
    try:  # the memoised answer without a further call: this is what an engine's every lookup costs
        hit = _MEMO.get(memo_key)
    except TypeError:
        hit = None
    return hit if hit is not None else _memoised(
        memo_key, _compute, num_heads, kv_cache_dtype, device=device, sparse=sparse, db=db, page_size=page_size,
        query_dtype=query_dtype, topk=topk, geometry=geometry, q_len=q_len)


def _memoised(memo_key: tuple, compute, *args, **kwargs):
    """The answer stored for `memo_key` in this process, or `compute(*args, **kwargs)`'s, stored (unless a key
    part is unhashable: computing the answer then says what is wrong). Shared by `lookup` and `kernel_tile`
    (the arguments are passed, not closed over: a closure made each memoised lookup 0.3 us slower)."""
    try:
        hit = _MEMO.get(memo_key)
    except TypeError:
        hit, memo_key = None, None
    if hit is not None:
        return hit
    answer = compute(*args, **kwargs)
    if memo_key is not None:
        with _LOCK:
            answer = _MEMO.setdefault(memo_key, answer)
    return answer


def _problem(num_heads, kv_cache_dtype, *, sparse, page_size, query_dtype, topk, geometry, q_len) -> Problem:
    if not isinstance(sparse, bool):
        raise ValueError(f"sparse must be True or False, got {sparse!r}")
    if topk is not None and not sparse:
        sparse = True
    if isinstance(geometry, dict):
        try:
            geometry = Geometry(**geometry)
        except TypeError as exc:
            raise ValueError(f"bad geometry {geometry!r}: {exc}") from None
    if geometry is not None and not isinstance(geometry, Geometry):
        raise ValueError(f"geometry must be a Geometry or a dict of its fields, got {geometry!r}")
    return Problem(num_heads=num_heads, kv_cache_dtype=kv_cache_dtype, query_dtype=query_dtype,
                   geometry=geometry or Geometry(), page_size=page_size,
                   topk=(topk or DEFAULT_SPARSE_TOPK) if sparse else None, q_len=q_len)


def device_from(device) -> DeviceInfo:
    """A `DeviceInfo` from the `device` argument of `lookup` (dict, DeviceInfo or DeviceSpec)."""
    if isinstance(device, DeviceInfo):
        return device
    if isinstance(device, DeviceSpec):
        return DeviceInfo(name=device.name, compute_capability=device.compute_capability)
    if not isinstance(device, dict):
        raise ValueError(f"device must be a dict with 'name' and 'compute_capability', got {device!r}")
    known = set(DeviceInfo.__dataclass_fields__)
    unknown = sorted(set(device) - known)
    if unknown:
        raise ValueError(f"unknown device field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    name = device.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"device needs a non-empty 'name', got {name!r}")
    if "compute_capability" not in device:
        raise ValueError("device needs a 'compute_capability' such as (9, 0)")
    fields = dict(device, name=name.strip(),
                  compute_capability=parse_compute_capability(device["compute_capability"]))
    try:
        return DeviceInfo(**fields)
    except TypeError as exc:
        raise ValueError(f"bad device {device!r}: {exc}") from None


def _probe_local_uncached() -> DeviceInfo:
    from mla_tune.backends.nvml_probe import ProbeError, local_device

    try:
        return local_device()
    except ProbeError as exc:
        raise NoDeviceError(str(exc)) from None


class _ProbeCache:
    """Probe the local GPU once per process (NVML init costs tens of milliseconds)."""

    def __init__(self):
        self._device: DeviceInfo | None = None

    def __call__(self) -> DeviceInfo:
        if self._device is None:
            self._device = _probe_local_uncached()
        return self._device

    def cache_clear(self):
        self._device = None


_probe_local = _ProbeCache()


def _warn_once(message: str) -> None:
    with _LOCK:
        if message in _WARNED:
            return
        _WARNED.add(message)
    import logging  # only when there is something to say: it costs milliseconds at engine startup
    import re

    # Store text may hold control characters (an ANSI sequence in a node name): logs often reach a terminal.
    shown = re.sub("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]", lambda m: f"\\x{ord(m.group()):02x}"
                   if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", message)
    logging.getLogger("mla_tune").warning("mla-tune lookup: %s; using vLLM's static choice", shown)


def _sku_matches(stored_sku: str, device: DeviceInfo) -> bool:
    """Stored SKU "name | cc | NGiB | pci[ | MIG profile]" against a device that may lack memory/PCI id."""
    parts = [p.strip() for p in stored_sku.split("|")]
    if len(parts) < 4:
        return stored_sku == device.sku
    name, cc, memory, pci = parts[:4]
    mig = parts[4].removeprefix("MIG ").strip() if len(parts) > 4 else None
    if name != device.name or cc != f"{device.compute_capability[0]}.{device.compute_capability[1]}":
        return False
    if device.memory_total_mib and memory != f"{device.memory_class_gib}GiB":
        return False
    if device.pci_device_id and pci not in ("-", device.pci_device_id):
        return False
    return (mig or None) == (device.mig_profile or None)


def _stored_decisions(url: str | None, key, device: DeviceInfo):
    """(decisions for this key on a matching SKU, newest first; warning or "")."""
    try:
        from mla_tune.store.engine import StoreError
        from mla_tune.store.readonly import find_decisions
    except ImportError as exc:  # a broken installation must not stop a serving engine
        return [], f"the store code cannot be imported ({exc})"
    fields = {name: value for name, value in key.to_dict().items() if name != "sku"}
    try:
        decisions = find_decisions(url, device_name=device.name, key_fields=fields)
    except StoreError as exc:
        return [], str(exc)
    except Exception as exc:  # noqa: BLE001 - the contract: never raise because of the store
        return [], f"unexpected store error {type(exc).__name__}: {' '.join(str(exc).split())}"
    matching = [d for d in decisions if _sku_matches(d.key.sku, device)]
    matching.sort(key=lambda d: d.decided_at, reverse=True)
    return matching, ""


def _resolve(num_heads, kv_cache_dtype, *, device, sparse, db, page_size, query_dtype, topk, geometry, q_len):
    """(problem, device facts, decision key) of a lookup's arguments; ValueError for invalid ones."""
    from mla_tune.store.records import DecisionKey

    problem = _problem(num_heads, kv_cache_dtype, sparse=sparse, page_size=page_size,
                       query_dtype=query_dtype, topk=topk, geometry=geometry, q_len=q_len)
    if db is not None and (not isinstance(db, str) or not db.strip()):
        raise ValueError(f"db must be a database URL string, got {db!r}")
    info = _probe_local() if device is None else device_from(device)
    return problem, info, DecisionKey.of(info.sku, info.compute_capability, problem)


def _compute(num_heads, kv_cache_dtype, *, device, sparse, db, page_size, query_dtype, topk, geometry,
             q_len) -> Choice:
    problem, info, key = _resolve(num_heads, kv_cache_dtype, device=device, sparse=sparse, db=db,
                                  page_size=page_size, query_dtype=query_dtype, topk=topk, geometry=geometry,
                                  q_len=q_len)
    spec = info.spec
    # vLLM's choice on this GPU as vLLM itself would make it: the packages of *this* process (an init
    # container, a CLI venv) say nothing about the engine's, so they are not checked here.
    static = static_choice(problem, spec, kv_cache_spelling=kv_cache_dtype)
    vllm_choice = static.backend

    decisions, warning = _stored_decisions(db, key, info)
    if warning:
        _warn_once(warning)
        why = f"the store could not be read: {warning}"
    elif not decisions:
        why = f"no tuned decision for {key.label} on {info.name} ({spec.cc_label})"
    else:
        from mla_tune.backends.software import compatibility_problems, current_fingerprint

        current = current_fingerprint(driver_version=info.driver_version)
        stale = []
        for decision in decisions:
            try:
                problems = compatibility_problems(decision.fingerprint, current)
                if decision.winner not in BACKENDS:
                    problems.append(f"its winner {decision.winner!r} is not a backend this mla-tune knows")
                if not problems:
                    return _tuned_choice(decision, key, problem, spec, vllm_choice)
            except Exception as exc:  # noqa: BLE001 - a stored value no check foresaw must not stop an engine
                problems = [f"its stored values cannot be used ({type(exc).__name__}: {' '.join(str(exc).split())})"]
            stale.append("; ".join(problems))
        why = (f"the tuned decision for {key.label} was measured with other software "
               f"({stale[0]}); re-run `mla-tune` to tune again")
    return _fallback_choice(static, problem, spec, key, why, warnings=(warning,) if warning else ())


def _fallback_choice(static, problem, spec, key, why, *, warnings) -> Choice:
    winner, skipped, order = static.backend, static.skipped, list(static.order)
    if winner is None:
        listed = "; ".join(f"{name}: {' '.join(texts)}" for name, texts in skipped.items())
        raise NoEligibleBackendError(f"no MLA backend in vLLM's priority list ({static.rule}) can run "
                                     f"{key.label} on compute capability {spec.cc_label} ({listed})")
    why = f"{why}; vLLM's static choice by {static.rule}"
    reasons: dict[str, tuple[str, ...]] = {}
    for name in candidates():
        if name == winner:
            continue
        found = skipped.get(name) or backend_reasons(name, problem, spec, check_packages=False)
        if found:
            reasons[name] = tuple(found)
        elif name in order:
            reasons[name] = (f"{winner} comes before it in vLLM's static priority "
                             f"(position {order.index(name) + 1} of {len(order)})", why)
        else:
            reasons[name] = ("it is not in vLLM's static priority list for compute capability "
                             f"{spec.cc_label}; only a tuned decision can choose it", why)
    return Choice(backend=winner, source="fallback", reasons=types.MappingProxyType(reasons), why=why,
                  key=types.MappingProxyType(key.to_dict()), static_choice=winner, warnings=warnings)


def _tuned_choice(decision, key, problem, spec, vllm_choice) -> Choice:
    winner = decision.winner
    best = decision.scores.get(winner)
    reasons: dict[str, tuple[str, ...]] = {}
    for name in candidates():
        if name == winner:
            continue
        if name in decision.failures:
            reasons[name] = (decision.failures[name],)
        elif name in decision.scores and best:
            score = decision.scores[name]
            text = (f"score {score:.3f} against {winner}'s {best:.3f} "
                    f"(geometric mean of time / per-shape best; {100 * (score / best - 1):+.1f}%)")
            if decision.kept_static and score <= best:
                text += (f"; within the noise margin {100 * decision.noise_margin:.1f}% of vLLM's static "
                         f"choice {winner}, which was kept")
            reasons[name] = (text,)
        else:
            found = backend_reasons(name, problem, spec)
            reasons[name] = tuple(found) or ("it was not measured in the tuned decision",)
    margin = f", {100 * decision.margin:.1f}% ahead of {decision.runner_up}" \
        if decision.margin is not None and decision.runner_up else ""
    why = f"tuned on {decision.key.sku} at {decision.decided_at or 'an unknown time'}{margin}"
    return Choice(backend=winner, source="tuned", reasons=types.MappingProxyType(reasons), why=why,
                  key=types.MappingProxyType(decision.key.to_dict()),
                  static_choice=decision.static_choice or vllm_choice, runner_up=decision.runner_up,
                  margin=decision.margin, decided_at=decision.decided_at,
                  scores=types.MappingProxyType(dict(decision.scores)),
                  engine_best=None if decision.engine_best is None
                  else types.MappingProxyType(dict(decision.engine_best)),
                  plugin_scores=None if decision.plugin_scores is None
                  else types.MappingProxyType(dict(decision.plugin_scores)))
