"""`kernel_tile`: the launch tile of our Triton kernel that `mla-tune` measured fastest on this GPU.

Read like `lookup` (same arguments, same store, same memo, never raises because of the store, no torch).
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass

from mla_tune.runtime import _freeze, _memoised, _resolve, _sku_matches


@dataclass(frozen=True)
class TileChoice:
    """The launch tile of our Triton kernel for one problem and batch shape, and why.

    Attributes:
        tile: the `Tile` fields the tuner measured fastest on this GPU, for
            `mla_decode(..., tile=tile)` (`TritonMLA(tile=Tile(**tile))`); None: use the default tile.
        source: "tuned" (a stored measurement) or "default".
        why: one sentence: which measurement it comes from, or why there is none.
        measured_shape: (batch_size, kv_len) of that measurement, the stored shape nearest to the one asked.
    """

    tile: types.MappingProxyType | None
    source: str
    why: str
    measured_shape: tuple[int, int] | None = None


def kernel_tile(num_heads, kv_cache_dtype, *, batch_size, kv_len, device=None, sparse=False, db=None,
                page_size=64, query_dtype="bf16", topk=None, geometry=None, q_len=1) -> TileChoice:
    """The tuned launch tile of MLA_TUNE_TRITON (MLA_TUNE_TRITON_SPARSE when sparse) for a batch shape on a GPU.

    `mla-tune` refines our Triton kernel per device: at each shape it times the default tile and a few
    alternatives the kernel package proposes, and stores the fastest correct one with the measurement. This
    returns the one stored at the shape nearest to (`batch_size`, `kv_len`) (distance in log batch + log
    length), measured with compatible software on a GPU of this SKU. Arguments as in `lookup`; it never
    raises because of the store, never imports torch, and is memoised per process like `lookup`.

    Raises:
        ValueError: invalid arguments (as `lookup`, and a batch size or length that is not a positive int).
    """
    return _memoised(("kernel_tile", type(num_heads), num_heads, kv_cache_dtype, type(batch_size), batch_size,
                      type(kv_len), kv_len, _freeze(device), sparse, db, page_size, query_dtype, topk,
                      _freeze(geometry), q_len),
                     _compute_tile, num_heads, kv_cache_dtype, batch_size=batch_size, kv_len=kv_len, device=device,
                     sparse=sparse, db=db, page_size=page_size, query_dtype=query_dtype, topk=topk, geometry=geometry,
                     q_len=q_len)


def _compute_tile(num_heads, kv_cache_dtype, *, batch_size, kv_len, device, sparse, db, page_size, query_dtype,
                  topk, geometry, q_len) -> TileChoice:
    for name, value in (("batch_size", batch_size), ("kv_len", kv_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    problem, info, key = _resolve(num_heads, kv_cache_dtype, device=device, sparse=sparse, db=db,
                                  page_size=page_size, query_dtype=query_dtype, topk=topk, geometry=geometry,
                                  q_len=q_len)
    backend = "MLA_TUNE_TRITON_SPARSE" if problem.sparse else "MLA_TUNE_TRITON"
    try:
        from mla_tune.store.readonly import find_tiles

        fields = {name: value for name, value in key.to_dict().items() if name != "sku"}
        rows = [r for r in find_tiles(db, backend=backend, device_name=info.name, key_fields=fields)
                if _sku_matches(r["sku"], info) and isinstance(r["params"], dict)
                and isinstance(r["params"].get("tile"), dict)]
    except Exception as exc:  # noqa: BLE001 - the contract: never raise because of the store
        return TileChoice(None, "default", f"the store could not be read: {' '.join(str(exc).split())}")
    if not rows:
        return TileChoice(None, "default", f"no tuned {backend} launch for {key.label} on {info.name}")
    from mla_tune.backends.software import compatibility_problems, current_fingerprint

    current = current_fingerprint(driver_version=info.driver_version)
    usable = [r for r in rows if not compatibility_problems(r["fingerprint"], current)]
    if not usable:
        why = "; ".join(compatibility_problems(rows[0]["fingerprint"], current))
        return TileChoice(None, "default", f"the tuned {backend} launches for {key.label} were measured with "
                                           f"other software ({why}); re-run `mla-tune` to tune again")
    best = min(usable, key=lambda r: abs(math.log(r["batch_size"] / batch_size)) + abs(math.log(r["kv_len"] / kv_len)))
    params = best["params"]
    default_ms = params.get("default_median_ms")
    gain = "" if not default_ms else f", {default_ms:.4g} ms with the default {params.get('default_label', '')}"
    return TileChoice(types.MappingProxyType(dict(params["tile"])), "tuned",
                      f"measured at batch {best['batch_size']}, kv_len {best['kv_len']} on {best['sku']} "
                      f"({best['measured_at']}): {params.get('label', '')}{gain}",
                      (best["batch_size"], best["kv_len"]))
