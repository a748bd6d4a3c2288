"""vLLM's static MLA backend priority, and the fallback choice it implies.

vLLM orders its MLA backends in `_get_backend_priorities` (`vllm/platforms/cuda.py`);
each backend's own validation then drops those that do not fit, and the first valid
one wins. Which rule answers here:

- `vllm_version` given: mla-tune's pinned table for that release or commit
  (`priority_tables.PINNED`);
- `vllm_version=None` and vLLM installed: the installed vLLM's own function when
  vLLM is already loaded in this process (a serving engine, its plugin) or when
  mla-tune has no table for the installed version, and `vllm.platforms.cuda`
  imports (it needs libcuda); else the pinned table of the installed version
  (checked against vLLM's own function by the `vllm` tests), else the newest
  pinned table, each saying why; so a lookup in a CLI or an init container
  imports no torch through vLLM;
- `vllm_version=None` and no vLLM: the newest pinned table.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from mla_tune.backends.priority_tables import NEWEST, PINNED, PinnedPriority
from mla_tune.backends.problem import DeviceSpec, Problem, is_vllm_kv_cache_dtype, parse_compute_capability

# mla-tune spellings vLLM does not accept, mapped to vLLM's name for the same cache.
_TO_VLLM_SPELLING = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp8_e4m3fn": "fp8_e4m3",
                     "fp8_e4m3_per_token_head": "fp8_per_token_head"}
_COMMIT = re.compile(r"[0-9a-f]{4,40}")   # git's shortest abbreviation is 4 hex digits


@dataclass(frozen=True)
class PriorityRule:
    """The rule that orders vLLM's MLA backends, and a sentence naming it.

    Attributes:
        vllm_version: the release or commit whose rule this is ("0.33.0", "81be2e09aebf").
        source: "installed" (the installed vLLM's own function) or "pinned" (mla-tune's table).
        description: names the rule and, for a fallback, why it was used.
        table: the pinned table (also set beside an installed vLLM's function when its version has one).
        function: the installed vLLM's own rule, called as (major, minor, kv spelling, heads, head_size).
        kv_cache_dtypes: vLLM's own `--kv-cache-dtype` spellings this rule accepts beside mla-tune's.
    """

    vllm_version: str
    source: str
    description: str
    table: PinnedPriority | None = field(default=None, repr=False)
    function: Callable | None = field(default=None, repr=False, compare=False)
    kv_cache_dtypes: frozenset[str] = field(default=frozenset(), repr=False)

    def accepts(self, spelling: str) -> bool:
        """True when `spelling` is an mla-tune spelling or one of this vLLM's own."""
        return is_vllm_kv_cache_dtype(spelling) or spelling.strip().lower() in self.kv_cache_dtypes


def pinned_table(vllm_version: str) -> PinnedPriority:
    """The pinned table of a release ("0.33.0", "v0.33.0") or commit prefix ("81be2e09").

    Raises:
        ValueError: unknown or ambiguous version; the message lists the known ones.
    """
    if not isinstance(vllm_version, str) or not vllm_version.strip():
        raise ValueError(f"vllm_version must be a release or commit string, got {vllm_version!r}")
    text = vllm_version.strip().lower()
    text = text[1:] if re.fullmatch(r"v\d.*", text) else text
    for table in PINNED:
        if table.is_release and table.version == text:
            return table
    matches = []
    if _COMMIT.fullmatch(text):
        matches = [t for t in PINNED if t.commit.startswith(text) or text.startswith(t.commit)]
    if len(matches) == 1:
        return matches[0]
    known = ", ".join(f"release {t.version} (commit {t.commit})" if t.is_release else f"commit {t.version}"
                      for t in PINNED)
    what = "ambiguous" if matches else "unknown"
    raise ValueError(f"{what} vllm_version {vllm_version!r}; mla-tune has vLLM priority tables for {known}; "
                     "a commit may be given by any prefix of at least 4 hex digits")


def table_for_installed(version: str) -> PinnedPriority | None:
    """The pinned table of an installed vLLM's version string ("0.33.0+cu130", "0.34.0.dev3+g81be2e09a"), or None."""
    public, _, local = version.partition("+")
    try:
        return pinned_table(public)
    except ValueError:
        pass
    commit = re.search(r"(?:^|\.)g([0-9a-f]{7,40})(?:\.|$)", local)
    if commit:
        try:
            return pinned_table(commit.group(1))
        except ValueError:
            return None
    return None


def _pinned_rule(table: PinnedPriority, description: str) -> PriorityRule:
    return PriorityRule(table.version, "pinned", description, table=table, kv_cache_dtypes=table.kv_cache_dtypes)


def installed_rule() -> PriorityRule:
    """The rule of the vLLM installed in this environment (see the module docstring)."""
    return _installed_rule("vllm" in sys.modules)


@functools.cache
def _installed_rule(vllm_loaded: bool) -> PriorityRule:
    from importlib import metadata

    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return _pinned_rule(NEWEST, f"mla-tune's pinned table for {NEWEST.label}, the newest it knows "
                                    "(vLLM is not installed here)")
    table = table_for_installed(version)
    if table is not None and not vllm_loaded:
        return _pinned_rule(table, f"mla-tune's pinned table for {table.label}, the installed version (vLLM is "
                                   "not loaded in this process, and importing it only to ask would cost seconds)")
    try:
        from vllm.platforms.cuda import _get_backend_priorities
        from vllm.platforms.interface import DeviceCapability

        function = functools.partial(_call_vllm, _get_backend_priorities, DeviceCapability)
        function(9, 0, "auto", 128, 576)   # a call that must work before it is trusted
    except Exception as exc:  # noqa: BLE001 - any failure to load vLLM's rule falls back to a table
        error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        if table is not None:
            return _pinned_rule(table, f"mla-tune's pinned table for {table.label}, the installed version "
                                       f"(vLLM's own rule could not be loaded: {error})")
        return _pinned_rule(NEWEST, f"mla-tune's pinned table for {NEWEST.label}, the newest it knows; the "
                                    f"installed vLLM {version} has no pinned table and its own rule could not "
                                    f"be loaded ({error}), so its order may differ")
    dtypes = table.kv_cache_dtypes if table is not None else frozenset()
    try:
        from vllm.config.cache import KV_CACHE_DTYPES

        dtypes = frozenset(KV_CACHE_DTYPES)
    except Exception:  # noqa: BLE001 - an older vLLM without the list: the table's spellings stand
        pass
    return PriorityRule(version, "installed", f"the installed vLLM {version}'s own _get_backend_priorities",
                        table=table, function=function, kv_cache_dtypes=dtypes)


def _call_vllm(get_priorities, device_capability, major, minor, kv_cache_dtype, num_heads, head_size) -> list[str]:
    found = get_priorities(use_mla=True, device_capability=device_capability(major, minor), num_heads=num_heads,
                           kv_cache_dtype=kv_cache_dtype, head_size=head_size)
    return [getattr(backend, "name", str(backend)) for backend in found]


def priority_rule(vllm_version: str | None = None) -> PriorityRule:
    """The rule `static_priority` uses for `vllm_version` (see the module docstring)."""
    if vllm_version is None:
        return installed_rule()
    table = pinned_table(vllm_version)
    return _pinned_rule(table, f"mla-tune's pinned table for {table.label}")


def _positive_or_none(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"{name} must be a positive integer or None, got {value!r}")


def ordered(rule: PriorityRule, *, compute_capability, kv_cache_dtype: str = "auto", num_heads: int | None = None,
            head_size: int | None = None) -> list[str]:
    """`rule`'s unfiltered MLA list for these arguments (validated here, whichever rule answers).

    Raises:
        ValueError: bad compute capability, dtype, head count or head size.
    """
    major, minor = parse_compute_capability(compute_capability)
    if not isinstance(kv_cache_dtype, str) or not rule.accepts(kv_cache_dtype):
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r} for {rule.description}")
    _positive_or_none("num_heads", num_heads)
    _positive_or_none("head_size", head_size)
    raw = kv_cache_dtype.strip().lower()
    spelling = _TO_VLLM_SPELLING.get(raw, raw)
    if rule.function is not None:
        return rule.function(major, minor, spelling, num_heads, head_size)
    return rule.table.order(major, spelling, num_heads, head_size)


def static_priority(*, compute_capability, kv_cache_dtype: str = "auto", num_heads: int | None = None,
                    head_size: int | None = None, vllm_version: str | None = None) -> list[str]:
    """vLLM's MLA priority list, unfiltered, as vLLM enum names.

    Args:
        compute_capability: (major, minor) of the GPU, or "9.0".
        kv_cache_dtype: a vLLM `--kv-cache-dtype` spelling of that version, or mla-tune's (`bf16`, ...).
        num_heads: query heads per rank; None when unknown (vLLM then uses its
            "more than 16 heads" ordering for unquantized caches on SM100).
        head_size: what vLLM passes for an MLA layer, kv_lora_rank + qk_rope_head_dim
            (576 for DeepSeek, 512 for a NoPE model); None when unknown.
        vllm_version: a release ("0.33.0") or commit prefix ("81be2e09"); None = the
            installed vLLM's rule, else the newest pinned table (`priority_rule`).

    Raises:
        ValueError: bad argument, or a vllm_version mla-tune has no table for.
    """
    return ordered(priority_rule(vllm_version), compute_capability=compute_capability,
                   kv_cache_dtype=kv_cache_dtype, num_heads=num_heads, head_size=head_size)


@dataclass(frozen=True)
class StaticChoice:
    """The backend vLLM would pick statically, and which vLLM rule said so.

    Attributes:
        backend: the first eligible entry of the list; None when nothing is eligible.
        skipped: {backend: reasons} for every entry before the winner (all entries when None).
        order: the unfiltered list.
        vllm_version: the release or commit of the rule ("0.33.0", "81be2e09aebf").
        rule: sentence naming the rule, for a `why`.
    """

    backend: str | None
    skipped: dict[str, list[str]]
    order: tuple[str, ...]
    vllm_version: str
    rule: str


def static_choice(problem: Problem, device: DeviceSpec, *, kv_cache_spelling: str | None = None,
                  check_packages: bool = False, vllm_version: str | None = None) -> StaticChoice:
    """The backend vLLM would pick: the first eligible entry of its priority list.

    Args:
        problem: the decode problem; its geometry gives vLLM's head_size.
        device: the GPU.
        kv_cache_spelling: the user's `--kv-cache-dtype` spelling (vLLM's quantized test
            reads the raw string); defaults to the problem's canonical dtype.
        check_packages: also require the backends' packages in *this* process. Off by
            default: the caller (a CLI, an init container, the tuner) is usually not the
            engine's process, and vLLM's choice is made with vLLM's kernels installed.
        vllm_version: as in `static_priority`.
    """
    from mla_tune.backends.registry import BACKENDS, backend_reasons

    rule = priority_rule(vllm_version)
    order = ordered(rule, compute_capability=device.compute_capability,
                    kv_cache_dtype=kv_cache_spelling or problem.kv_cache_dtype, num_heads=problem.num_heads,
                    head_size=problem.geometry.head_size)
    skipped: dict[str, list[str]] = {}
    for name in order:
        if name not in BACKENDS:
            skipped[name] = [f"{name} is in the priority list of {rule.description}, but this mla-tune does not "
                             "know it and cannot check whether it runs this problem; it is skipped, so vLLM may "
                             "pick it where mla-tune names a later backend"]
            continue
        reasons = backend_reasons(name, problem, device, check_packages=check_packages)
        if not reasons:
            return StaticChoice(name, skipped, tuple(order), rule.vllm_version, rule.description)
        skipped[name] = reasons
    return StaticChoice(None, skipped, tuple(order), rule.vllm_version, rule.description)
