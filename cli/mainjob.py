"""What `mla-tune` with no command does: tune this GPU, or explain why not and show the fallback."""

from __future__ import annotations

import click

from mla_tune.cli.output import table


def static_table() -> None:
    """Print vLLM's static choice for DeepSeek-style heads x KV dtype on common GPUs."""
    from mla_tune.backends.common_cases import COMMON_HEADS, common_static_choices

    rows: dict[tuple, dict[int, str]] = {}
    for case in common_static_choices():
        label = (case.device.name, case.device.cc_label, case.kv_cache_dtype,
                 "sparse (top-k 2048)" if case.sparse else "dense")
        rows.setdefault(label, {})[case.num_heads] = case.backend or "none: vLLM refuses to start"
    table(f"vLLM's static MLA choice for DeepSeek heads per rank {'/'.join(map(str, COMMON_HEADS))} "
          f"(TP 1/2/4/8), kernels assumed installed",
          ["GPU", "cc", "KV cache", "attention", "vLLM's choice"],
          [list(label) + [_by_heads(by_heads)] for label, by_heads in rows.items()])


def _by_heads(by_heads: dict[int, str]) -> str:
    """"X" when every head count gives X, else "128/64/32 heads: X; 16 heads: Y"."""
    groups: dict[str, list[int]] = {}
    for heads, backend in by_heads.items():
        groups.setdefault(backend, []).append(heads)
    if len(groups) == 1:
        return next(iter(groups))
    return "; ".join(f"{'/'.join(map(str, heads))} heads: {backend}" for backend, heads in groups.items())


def run_main_job(ctx: click.Context) -> None:
    """Probe; without a GPU say so and print the static table; with one, run the tuner's main job."""
    from mla_tune.tuner.probe import ProbeError, probe_devices

    try:
        probe_devices()
    except ProbeError as exc:
        click.echo(f"No NVIDIA GPU here, so nothing can be tuned: {exc}.")
        click.echo("Showing vLLM's static choices, which `mla-tune lookup` returns until a GPU node is tuned.")
        static_table()
        return
    from mla_tune.cli.tune import main_job

    main_job(ctx)
