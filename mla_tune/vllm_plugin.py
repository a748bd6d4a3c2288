"""vLLM general plugin: pick the MLA attention backend from the mla-tune table at startup.

vLLM loads every entry point of the group `vllm.general_plugins` (ours:
`mla_tune = mla_tune.vllm_plugin:register`) in each process it starts, before
the process does any work, and calls it with no arguments; `VLLM_PLUGINS`, when
set, lists the plugin names allowed to load.

What `register` does, when vLLM is importable and `MLA_TUNE_VLLM_PLUGIN=1`:
it wraps `EngineArgs.create_engine_config` once per process. When the engine
config is built for an MLA model and the user chose no backend (no
`--attention-backend`, no `attention_config.backend`, no
`VLLM_ATTENTION_BACKEND`), it looks the model's key up in the table
(`mla_tune.lookup`, database from `MLA_TUNE_DB`) and, when the answer was
tuned and vLLM has that backend, sets `EngineArgs.attention_backend`. A
fallback answer changes nothing: it is vLLM's own static choice.

It is inert without vLLM or without `MLA_TUNE_VLLM_PLUGIN=1`, and it never
raises into vLLM: every problem is logged as one warning and the engine
starts with its own choice. It has been tested against a minimal fake host
that follows the plugin contract, not inside a real vLLM.
"""

from __future__ import annotations

import importlib.util
import logging
import os

logger = logging.getLogger("mla_tune.vllm_plugin")

ENABLE_ENV = "MLA_TUNE_VLLM_PLUGIN"
DEVICE_ENV = "MLA_TUNE_VLLM_DEVICE"   # "NAME;MAJOR.MINOR": skip the NVML probe
_WRAPPED = "_mla_tune_wrapped"


def enabled() -> bool:
    """True when the operator opted in with `MLA_TUNE_VLLM_PLUGIN=1` (or true/yes/on)."""
    return os.environ.get(ENABLE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def register() -> None:
    """The `vllm.general_plugins` entry point; never raises."""
    try:
        _register()
    except Exception as exc:  # the engine must start whatever happens here
        logger.warning("mla-tune plugin disabled: %s: %s", type(exc).__name__, exc)


def _register() -> None:
    if not enabled():
        logger.debug("mla-tune plugin inert: %s is not set to 1", ENABLE_ENV)
        return
    if importlib.util.find_spec("vllm") is None:
        return
    from vllm.engine import arg_utils

    engine_args_cls = arg_utils.EngineArgs
    original = engine_args_cls.create_engine_config
    if getattr(original, _WRAPPED, False):
        return  # already wrapped in this process

    def create_engine_config(self, *args, **kwargs):
        try:
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
    picked = choice_for_engine(choice, "vllm")
    if picked.engine_backend is None:
        logger.info("mla-tune: %s", picked.reason)
        return None
    engine_args.attention_backend = _as_vllm_enum(picked.engine_backend)
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
        except (ImportError, AttributeError, KeyError):
            continue
    return name
