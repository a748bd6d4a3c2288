#!/usr/bin/env python3
"""Unpack vLLM's kernel files for the adapters on a machine where vLLM itself cannot be installed.

The lent GPU machines have torch 2.11 and no package registry; vLLM 0.33.0 needs torch 2.14. Its
kernels load there anyway (REFERENCE.md section 6). `../shared/tools/vllm-kernels` packs vLLM's
Python files and the FlashMLA / FA3 extensions into `.vllm/vllm-<version>-kernels.tar.xz`; this
helper unpacks it into `.vsite` and adds two small files beside it, so that vLLM's own Triton
kernels are kernels rather than placeholders:

- `vllm-<version>.dist-info/METADATA`: `vllm.triton_utils` reads vLLM's version (to rule out a
  CPU build) and disables Triton when it cannot;
- an `entry_points.txt` naming a platform plugin that keeps vLLM's platform "unspecified": with a
  version to read, vLLM would otherwise pick its CUDA platform, whose module imports
  `vllm._C_stable_libtorch` (92 MB), which is not carried.

Nothing here is imported by mla-tune; it only prepares the folder to put on PYTHONPATH.

Usage (from the project root, on the GPU machine):
    python3 bench/vllm_site.py                 # unpack .vllm/*.tar.xz into .vsite, print what loads
    export PYTHONPATH=$PWD/.vsite:$PYTHONPATH
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tarfile

PLUGIN_MODULE = "mla_tune_vllm_unspecified_platform"
PLUGIN_SOURCE = '''"""Keeps vLLM's platform unspecified where only its kernel files are present (bench/vllm_site.py)."""


def unspecified():
    return "vllm.platforms.interface.UnspecifiedPlatform"
'''


def write_shim(site: pathlib.Path, version: str) -> pathlib.Path:
    """Write the dist-info and the platform plugin module into `site`; returns the dist-info folder."""
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(
        f"[vllm.platform_plugins]\nmla_tune_unspecified = {PLUGIN_MODULE}:unspecified\n")
    (info / "top_level.txt").write_text("vllm\n")
    (site / f"{PLUGIN_MODULE}.py").write_text(PLUGIN_SOURCE)
    return info


def unpack(tarball: pathlib.Path, site: pathlib.Path) -> None:
    site.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball) as tar:
        tar.extractall(site, filter="data") if sys.version_info >= (3, 12) else tar.extractall(site)


def probe() -> list[str]:
    """One line per kernel module the adapters load: loaded, or the error."""
    lines = []
    for module in ("vllm", "vllm._flashmla_C", "vllm._flashmla_extension_C",
                   "vllm.third_party.flashmla.flash_mla_interface", "vllm.vllm_flash_attn.flash_attn_interface",
                   "vllm.v1.attention.ops.triton_decode_attention", "vllm.triton_utils",
                   "vllm.v1.attention.backends.mla.flashmla", "vllm.v1.attention.backends.mla.triton_mla"):
        try:
            __import__(module)
            lines.append(f"  {module}: loaded")
        except Exception as exc:  # noqa: BLE001 - the point is to say what fails
            lines.append(f"  {module}: {type(exc).__name__}: {exc}")
    try:
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON

        lines.append(f"  platform {type(current_platform).__name__}, vllm.triton_utils.HAS_TRITON={HAS_TRITON}")
    except Exception as exc:  # noqa: BLE001
        lines.append(f"  platform/triton_utils: {type(exc).__name__}: {exc}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tarball", default=None, help="default: the newest .vllm/vllm-*-kernels.tar.xz")
    ap.add_argument("--site", default=".vsite")
    ap.add_argument("--version", default="0.33.0")
    ap.add_argument("--no-probe", action="store_true")
    args = ap.parse_args()
    site = pathlib.Path(args.site).resolve()
    tarball = pathlib.Path(args.tarball) if args.tarball else max(pathlib.Path(".vllm").glob("vllm-*-kernels.tar.xz"),
                                                                  default=None)
    if tarball is None or not tarball.exists():
        print("no .vllm/vllm-*-kernels.tar.xz: run ../shared/tools/vllm-kernels first", file=sys.stderr)
        return 2
    if not (site / "vllm" / "__init__.py").exists():
        unpack(tarball, site)
    write_shim(site, args.version)
    print(f"vLLM {args.version} kernel files in {site} (from {tarball}); put it first on PYTHONPATH")
    if not args.no_probe:
        sys.path.insert(0, str(site))
        print("\n".join(probe()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
