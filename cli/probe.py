"""`mla-tune probe`: the GPUs NVML sees on this node."""

from __future__ import annotations

import click

from mla_tune.cli.output import fail, print_json, table


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def probe(as_json: bool) -> None:
    """List this node's GPUs (and MIG instances) with the SKU decisions are shared across.

    Exits with status 1 and one line when there is no NVIDIA driver or GPU.

    Example: mla-tune probe --json
    """
    from mla_tune.tuner.probe import ProbeError, probe_devices

    try:
        devices = probe_devices()
    except ProbeError as exc:
        raise fail(str(exc)) from None
    if as_json:
        print_json([dict(d.to_dict(), sku=d.sku) for d in devices])
        return
    table("GPUs (NVML)", ["index", "name", "cc", "memory GiB", "driver", "CUDA", "MIG", "SKU"],
          [[d.index, d.name, f"{d.compute_capability[0]}.{d.compute_capability[1]}", d.memory_class_gib,
            d.driver_version, d.cuda_driver_version, d.mig_profile or ("on" if d.mig_mode else "off"), d.sku]
           for d in devices])
