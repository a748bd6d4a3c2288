"""vLLM general plugin: pick the MLA attention backend from the mla-tune table at startup.

vLLM loads every entry point of the group `vllm.general_plugins` (ours:
`mla_tune = mla_tune.vllm_plugin:register`) in each process it starts, before
the process does any work, and calls it with no arguments; `VLLM_PLUGINS`, when
set, lists the plugin names allowed to load.

What `register` does, when vLLM is importable and `MLA_TUNE_VLLM_PLUGIN=1`:

1. It registers our Triton MLA kernels as vLLM attention backends
   (`register_backend`, names in `mla_tune.vllm_backends.BACKENDS`:
   MLA_TUNE_TRITON, dense; MLA_TUNE_TRITON_SPARSE, DeepSeek-V3.2), so
   `--attention-backend MLA_TUNE_TRITON` works in every process that loaded it.
2. It wraps `EngineArgs.create_engine_config` once per process. When the
   engine config is built for an MLA model and the user chose no backend (no
   `--attention-backend`, no `attention_config.backend`, no
   `VLLM_ATTENTION_BACKEND`), it looks the model's key up in the table
   (`mla_tune.lookup`, database from `MLA_TUNE_DB`) and, when the answer was
   tuned and vLLM has that backend, sets `EngineArgs.attention_backend`. A
   fallback answer changes nothing: it is vLLM's own static choice.
3. When the backend chosen (by the user or the table) is one of ours and our
   declared capabilities refuse the model (head size, dtype, KV-cache dtype,
   block size, heads per rank, compute capability), it logs one warning with
   the reasons and clears the choice, so vLLM's normal selection takes over.

It is inert without vLLM or without `MLA_TUNE_VLLM_PLUGIN=1`, and it never
raises into vLLM: every problem is logged as one warning and the engine
starts with its own choice. `plugin_status()` says, without importing torch or
vLLM, whether the plugin can serve our backends in this environment.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from dataclasses import dataclass

logger = logging.getLogger("mla_tune.vllm_plugin")

PLUGIN_NAME = "mla_tune"
MIN_VLLM = (0, 33)
ENABLE_ENV = "MLA_TUNE_VLLM_PLUGIN"
DEVICE_ENV = "MLA_TUNE_VLLM_DEVICE"   # "NAME;MAJOR.MINOR": skip the NVML probe
_WRAPPED = "_mla_tune_wrapped"


def enabled() -> bool:
    """True when the operator opted in with `MLA_TUNE_VLLM_PLUGIN=1` (or true/yes/on)."""
    return os.environ.get(ENABLE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class PluginStatus:
    """Whether vLLM in this environment will load the plugin and can run our backends.

    Attributes:
        installed: vLLM and our `vllm.general_plugins` entry point are both installed here.
        enabled: the operator opted in (`MLA_TUNE_VLLM_PLUGIN=1`) and `VLLM_PLUGINS` does not exclude us.
        can_serve: installed, enabled, a vLLM with `register_backend` by name (0.33 or newer) and the
            kernels' packages (torch, triton): vLLM can then run MLA_TUNE_TRITON and MLA_TUNE_TRITON_SPARSE.
        vllm_version: the installed vLLM's version, or None.
        reasons: why not, one sentence each (empty when `can_serve`).
    """

    installed: bool
    enabled: bool
    can_serve: bool
    vllm_version: str | None
    reasons: tuple[str, ...]


def plugin_status(*, check_opt_in: bool = True) -> PluginStatus:
    """Whether this environment's vLLM will load the plugin and can serve our backends (cheap: no torch, no vLLM
    import; reads package metadata and the environment).

    Args:
        check_opt_in: whether this process's `MLA_TUNE_VLLM_PLUGIN` and `VLLM_PLUGINS` count; False for a
            caller (such as `lookup --format vllm`) whose shell is not the engine's: then `enabled` still
            reports them, but `can_serve` and `reasons` do not depend on them.
    """
    from importlib import metadata

    reasons = []
    try:
        vllm_version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        vllm_version = None
        reasons.append("vLLM is not installed in this environment (no 'vllm' distribution)")
    try:
        ours = {ep.name: ep.value for ep in metadata.entry_points(group="vllm.general_plugins")}
    except Exception as exc:  # broken metadata of some other distribution
        ours = {}
        reasons.append(f"the vllm.general_plugins entry points could not be read ({type(exc).__name__}: {exc})")
    if ours.get(PLUGIN_NAME) != f"{__name__}:register":
        reasons.append(f"the entry point {PLUGIN_NAME} = {__name__}:register is not installed here "
                       f"(found {sorted(ours) or 'none'}); install mla-tune into vLLM's environment")
    installed = not reasons
    opt_in_reasons = []
    if not enabled():
        opt_in_reasons.append(f"{ENABLE_ENV} is {os.environ.get(ENABLE_ENV)!r}, not 1: the plugin is inert")
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in [name.strip() for name in allowed.split(",")]:
        opt_in_reasons.append(f"VLLM_PLUGINS={allowed!r} does not list {PLUGIN_NAME}, so vLLM does not load it")
    is_enabled = not opt_in_reasons
    if check_opt_in:
        reasons.extend(opt_in_reasons)
    if vllm_version is not None and _version_tuple(vllm_version) < MIN_VLLM:
        reasons.append(f"vLLM {vllm_version} is older than {'.'.join(map(str, MIN_VLLM))}, which registers "
                       "attention backends by name")
    for package in ("torch", "triton"):
        if importlib.util.find_spec(package) is None:
            reasons.append(f"{package} is not installed, and our kernels need it")
    return PluginStatus(installed=installed, enabled=is_enabled, can_serve=not reasons, vllm_version=vllm_version,
                        reasons=tuple(reasons))


def _version_tuple(version: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def register() -> None:
    """The `vllm.general_plugins` entry point; never raises."""
    try:
        _register()
    except Exception as exc:  # the engine must start whatever happens here
        logger.warning("mla-tune plugin disabled: %s: %s", type(exc).__name__, exc)


def register_backends() -> list[str]:
    """Register MLA_TUNE_TRITON and MLA_TUNE_TRITON_SPARSE with vLLM (once per process); return the names
    registered now. Raises what vLLM raises (`register` logs it)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from mla_tune.vllm_backends import BACKENDS

    added = []
    for name, caps in BACKENDS.items():
        if name in AttentionBackendEnum.__members__:
            continue  # this process registered it already (vLLM loads plugins more than once)
        register_backend(name, caps.class_path)
        added.append(name)
    return added


def _register() -> None:
    if not enabled():
        logger.debug("mla-tune plugin inert: %s is not set to 1", ENABLE_ENV)
        return
    if importlib.util.find_spec("vllm") is None:
        return
    try:
        register_backends()
    except Exception as exc:  # an older vLLM: the table's choice still applies to vLLM's own backends
        logger.warning("mla-tune could not register its attention backends: %s: %s", type(exc).__name__, exc)
    from vllm.engine import arg_utils

    engine_args_cls = arg_utils.EngineArgs
    original = engine_args_cls.create_engine_config
    if getattr(original, _WRAPPED, False):
        return  # already wrapped in this process

    def create_engine_config(self, *args, **kwargs):
        try:
            refuse_unfit_choice(self)
            apply_tuned_backend(self)
        except Exception as exc:
            logger.warning("mla-tune could not choose the MLA backend, vLLM chooses: %s: %s",
                           type(exc).__name__, exc)
        return original(self, *args, **kwargs)

    setattr(create_engine_config, _WRAPPED, True)
    create_engine_config.__wrapped__ = original
    create_engine_config.__doc__ = original.__doc__
    engine_args_cls.create_engine_config = create_engine_config


def user_choice(engine_args) -> str | None:
    """The backend the user chose (flag, attention config or environment), or None."""
    chosen = getattr(engine_args, "attention_backend", None)
    if chosen is not None:
        return str(getattr(chosen, "name", chosen))
    config = getattr(engine_args, "attention_config", None)
    backend = config.get("backend") if isinstance(config, dict) else getattr(config, "backend", None)
    if backend is not None:
        return str(getattr(backend, "name", backend))
    return os.environ.get("VLLM_ATTENTION_BACKEND") or None


def _device_override() -> dict | None:
    raw = os.environ.get(DEVICE_ENV, "").strip()
    if not raw:
        return None
    name, _, cc = raw.rpartition(";")
    major, _, minor = cc.partition(".")
    return {"name": name.strip(), "compute_capability": (int(major), int(minor or 0))}


def apply_tuned_backend(engine_args) -> str | None:
    """Set `engine_args.attention_backend` from the table; return the vLLM name set, or None.

    Leaves `engine_args` untouched when the user chose a backend, the model is
    not MLA, the answer is a fallback, or vLLM has no backend for the answer.
    """
    chosen = user_choice(engine_args)
    if chosen:
        logger.info("mla-tune: the user chose attention backend %s; leaving it", chosen)
        return None
    model_config = engine_args.create_model_config()
    if not getattr(model_config, "use_mla", False):
        return None
    hf = model_config.hf_text_config
    tp = int(getattr(engine_args, "tensor_parallel_size", 1) or 1)
    num_heads = int(hf.num_attention_heads) // tp
    topk = getattr(hf, "index_topk", None)
    kv_cache_dtype = str(getattr(engine_args, "kv_cache_dtype", "auto") or "auto")
    query_dtype = str(getattr(model_config, "dtype", "bfloat16")).removeprefix("torch.")
    geometry = _geometry(hf)

    import mla_tune
    from mla_tune.engines import choice_for_engine

    db = os.environ.get("MLA_TUNE_DB") or None
    choice = mla_tune.lookup(num_heads, kv_cache_dtype, sparse=topk is not None, topk=topk, geometry=geometry,
                             query_dtype=query_dtype, device=_device_override(), db=db)
    if choice.source != "tuned":
        logger.info("mla-tune: nothing tuned for %d heads, kv %s (%s); vLLM chooses",
                    num_heads, kv_cache_dtype, choice.why)
        return None
    # Inside vLLM our backends are registered, so the fastest kernel may be ours; when this vLLM cannot take
    # it (not registered, or our capabilities refuse the model), vLLM's own fastest timed backend is next.
    picked = choice_for_engine(choice, "vllm", plugin_missing=None)
    if picked.engine_backend and picked.engine_backend.startswith("MLA_TUNE_"):
        refused = our_refusals(picked.engine_backend, engine_args, model_config)
        if not refused and isinstance(_as_vllm_enum(picked.engine_backend), str):
            refused = [f"{picked.engine_backend} is not registered in this vLLM"]
        if refused:
            logger.warning("mla-tune: the tuned backend %s cannot run here (%s); using vLLM's fastest own backend",
                           picked.engine_backend, "; ".join(refused))
            picked = choice_for_engine(choice, "vllm", plugin_missing="; ".join(refused))
    if picked.engine_backend is None:
        logger.info("mla-tune: %s", picked.reason)
        return None
    backend = _as_vllm_enum(picked.engine_backend)
    engine_args.attention_backend = backend
    logger.info("mla-tune: attention backend %s for %d heads, kv %s (%s)",
                picked.engine_backend, num_heads, kv_cache_dtype, picked.reason)
    return picked.engine_backend


def _geometry(hf):
    """The model's MLA geometry from its Hugging Face config (None: DeepSeek's default)."""
    names = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    values = [getattr(hf, name, None) for name in names]
    if any(v is None for v in values):
        return None
    from mla_tune.backends.problem import Geometry

    return Geometry(*(int(v) for v in values))


def _as_vllm_enum(name: str):
    """vLLM's `AttentionBackendEnum` member when it can be found, else the plain name."""
    for module in ("vllm.v1.attention.backends.registry", "vllm.attention.backends.registry"):
        try:
            enum_cls = getattr(importlib.import_module(module), "AttentionBackendEnum")
            return enum_cls[name]
        except (ImportError, AttributeError, KeyError, ValueError):  # vLLM raises ValueError for unknown names
            continue
    return name


def our_refusals(name: str, engine_args, model_config=None) -> list[str]:
    """Why our backend `name` cannot run the model of `engine_args` (empty: it can, or `name` is not ours)."""
    from mla_tune.vllm_backends.capabilities import BACKENDS, refusal_reasons

    caps = BACKENDS.get(name)
    if caps is None:
        return []
    model_config = model_config or engine_args.create_model_config()
    if not getattr(model_config, "use_mla", False):
        return [f"{name} runs MLA models only; {getattr(model_config, 'model', 'this model')} is not one"]
    hf = model_config.hf_text_config
    tp = int(getattr(engine_args, "tensor_parallel_size", 1) or 1)
    kv_cache_dtype = str(getattr(engine_args, "kv_cache_dtype", "auto") or "auto")
    block_size = getattr(engine_args, "block_size", None)
    device = _device_override()
    if device is None:
        device = _local_device()
    return refusal_reasons(
        caps, head_size=int(hf.kv_lora_rank) + int(hf.qk_rope_head_dim), kv_lora_rank=int(hf.kv_lora_rank),
        model_dtype=str(model_config.dtype), kv_cache_dtype=kv_cache_dtype,
        block_size=int(block_size) if block_size else None, sparse=getattr(hf, "index_topk", None) is not None,
        capability=device["compute_capability"] if device else None,
        num_heads=int(hf.num_attention_heads) // tp)


def _local_device() -> dict | None:
    """This machine's GPU through NVML, or None when there is none (the selector checks it later)."""
    try:
        from mla_tune.tuner.probe import local_device

        found = local_device()
        return {"name": found.name, "compute_capability": tuple(found.compute_capability)}
    except Exception:
        return None


def refuse_unfit_choice(engine_args) -> str | None:
    """Clear the user's choice of one of our backends when it cannot run this model; return what was cleared.

    vLLM validates a chosen backend and refuses to start when it is invalid; for our backends the plugin
    checks first and lets vLLM's normal selection take over, with one warning that gives the reasons.
    """
    chosen = user_choice(engine_args)
    if chosen is None or not chosen.startswith("MLA_TUNE_"):
        return None
    refused = our_refusals(chosen, engine_args)
    if not refused:
        return None
    logger.warning("mla-tune: %s cannot run this model (%s); vLLM chooses the attention backend",
                   chosen, "; ".join(refused))
    if getattr(engine_args, "attention_backend", None) is not None:
        engine_args.attention_backend = None
    config = getattr(engine_args, "attention_config", None)
    if isinstance(config, dict):
        config.pop("backend", None)
    elif config is not None and getattr(config, "backend", None) is not None:
        config.backend = None
    if os.environ.get("VLLM_ATTENTION_BACKEND", "").startswith("MLA_TUNE_"):
        os.environ.pop("VLLM_ATTENTION_BACKEND")
    return chosen
