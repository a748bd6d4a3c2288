"""`mla-tune lookup`: the backend a serving engine should use, in the engine's words."""

from __future__ import annotations

import logging
import shlex

import click

from mla_tune.cli.output import echo, fail, print_json, safe, warn
from mla_tune.cli.params import ComputeCapability, db_option, problem_options
from mla_tune.engines import ENGINES

FORMATS = ("text", "json", "vllm", "sglang", "env")


@click.command()
@problem_options(heads_required=True)
@click.option("--device-name", default=None, metavar="NAME",
              help='GPU name as NVML reports it, e.g. "NVIDIA H100 80GB HBM3" (with --cc; default: probe).')
@click.option("--cc", "compute_capability", type=ComputeCapability(), default=None,
              help="Compute capability of --device-name, e.g. 9.0.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="text", show_default=True,
              help="text for people, json for programs, vllm/sglang for the engine's flag, env for scripts.")
@click.option("--engine", type=click.Choice(ENGINES), default=None,
              help="Answer with the best backend this engine has, ranked by the stored scores.")
@db_option
@click.pass_context
def lookup(ctx, num_heads, kv_cache_dtype, sparse, topk, page_size, query_dtype, device_name,
           compute_capability, fmt, engine) -> None:
    """Print the tuned backend for a problem on this GPU, or vLLM's static choice and why.

    A store that cannot be read is a warning on stderr, never a failure: the
    static choice is printed and the exit status is 0.

    --format vllm/sglang and --engine name the fastest timed backend that the
    engine runs under that name: our own kernels only where mla-tune's vLLM
    plugin is installed (run it in the engine's environment). With nothing
    tuned they print no flag, so the engine makes its own choice.

    Example: vllm serve deepseek-ai/DeepSeek-V3 $(mla-tune lookup --heads 16 --kv-cache-dtype fp8 --format vllm)
    """
    from mla_tune.cli.main import db_url
    from mla_tune.runtime import NoDeviceError, NoEligibleBackendError, lookup as run_lookup

    if num_heads is None:
        raise click.UsageError("missing option '--heads N': the query heads per rank (model heads / tensor "
                               "parallelism, e.g. 16 for DeepSeek-V3 at TP 8)")
    if kv_cache_dtype is None:
        raise click.UsageError("missing option '--kv-cache-dtype D': the engine's --kv-cache-dtype "
                               "(auto, bf16, fp8, ...)")
    if engine and fmt in ENGINES and fmt != engine:
        raise click.UsageError(f"--format {fmt} prints {fmt}'s flag; it cannot go with --engine {engine}")
    if (device_name is None) != (compute_capability is None):
        raise click.UsageError("--device-name and --cc go together (give both, or neither to probe the GPU)")
    if device_name is not None and not device_name.strip():
        raise click.BadParameter("must not be empty", param_hint="'--device-name'")
    device = None if device_name is None else {"name": device_name, "compute_capability": compute_capability}
    url = db_url(ctx)
    logging.getLogger("mla_tune").addHandler(logging.NullHandler())  # warnings are printed below, once
    try:
        choice = run_lookup(num_heads, kv_cache_dtype, device=device, sparse=sparse, db=url,
                            page_size=page_size, query_dtype=query_dtype, topk=topk)
    except NoDeviceError as exc:
        raise fail(f"{exc.detail}; pass --device-name NAME --cc X.Y to look up without a local GPU") from None
    except NoEligibleBackendError as exc:
        raise fail(str(exc)) from None
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    for text in choice.warnings:
        warn(f"{text}; using vLLM's static choice")
    ranked = None
    engine = engine or (fmt if fmt in ENGINES else None)
    if engine:
        from mla_tune.engines import choice_for_engine, vllm_plugin_missing

        missing = vllm_plugin_missing() if engine == "vllm" else "not vLLM"
        ranked = choice_for_engine(choice, engine, plugin_missing=missing)
    render(choice, fmt, ranked)


def render(choice, fmt: str, ranked=None) -> None:
    """Print `choice` in one of FORMATS; `ranked` is the `EngineChoice` when an engine was named."""
    if fmt == "json":
        data = choice.to_dict()
        if ranked is not None:
            data["engine"] = {"engine": ranked.engine, "backend": ranked.backend,
                              "engine_backend": ranked.engine_backend, "score": ranked.score,
                              "basis": ranked.basis, "reason": ranked.reason}
        print_json(data)
    elif fmt in ("vllm", "sglang"):
        if ranked.engine_backend:
            click.echo(f"--attention-backend {ranked.engine_backend}")
            echo(f"mla-tune: {ranked.reason}", err=True)
        else:
            echo(f"mla-tune: printing no flag: {ranked.reason}", err=True)
    elif fmt == "env":
        from mla_tune.engines import choice_for_engine, vllm_plugin_missing

        values = {"MLA_TUNE_BACKEND": choice.backend, "MLA_TUNE_SOURCE": choice.source,
                  "MLA_TUNE_VLLM_BACKEND": choice_for_engine(choice, "vllm", plugin_missing=vllm_plugin_missing())
                  .engine_backend or "",
                  "MLA_TUNE_SGLANG_BACKEND": choice_for_engine(choice, "sglang").engine_backend or ""}
        if ranked is not None:
            values["MLA_TUNE_ENGINE_BACKEND"] = ranked.engine_backend or ""
        click.echo(" ".join(f"{k}={shlex.quote(v)}" for k, v in values.items()))
    else:
        margin = f", margin {100 * choice.margin:.1f}% over {choice.runner_up}" \
            if choice.margin is not None and choice.runner_up else ""
        echo(f"{choice.backend} ({choice.source}{margin})")
        echo(f"  why: {choice.why}")
        if choice.source == "tuned" and choice.static_choice and choice.static_choice != choice.backend:
            echo(f"  vLLM's static choice would be {choice.static_choice}")
        if ranked is not None:
            echo(f"  for {ranked.engine}: {ranked.engine_backend or 'no flag'} ({ranked.reason})")
        for name, texts in choice.reasons.items():
            echo(f"  not {name}: {'; '.join(t for t in texts if t != choice.why)}")
