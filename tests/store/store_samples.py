"""Sample records for the store tests, and helpers to compare a database's contents."""

from __future__ import annotations

import hashlib
import os

from mla_tune.backends.device import DeviceInfo, SoftwareFingerprint
from mla_tune.store.records import Decision, DecisionKey, Measurement, ShapeWinner

H100 = DeviceInfo(name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0), uuid="GPU-aaaa-0001",
                  index=0, memory_total_mib=81559, driver_version="580.95", cuda_driver_version="13.0",
                  max_sm_clock_mhz=1980, power_limit_w=700.0, pci_device_id="0x233010DE")
H100_B = DeviceInfo(**{**H100.to_dict(), "uuid": "GPU-aaaa-0002", "index": 1})
H200 = DeviceInfo(name="NVIDIA H200", compute_capability=(9, 0), uuid="GPU-bbbb-0001",
                  memory_total_mib=143771, pci_device_id="0x233510DE", mig_mode=True,
                  mig_profile="3g.71gb")
FP = SoftwareFingerprint(torch="2.11.0", triton="3.6.0", flashinfer="0.7.2", cuda_runtime="13.0",
                         driver="580.95", mla_tune="0.1.0", kernel_hash="abc123")
FP_NEW = SoftwareFingerprint(**{**FP.to_dict(), "triton": "3.7.0"})


def key(num_heads: int = 16, kv_cache_dtype: str = "bf16", *, device: DeviceInfo = H100, **kw) -> DecisionKey:
    return DecisionKey(sku=device.sku, compute_capability="9.0", query_dtype="bf16",
                       kv_cache_dtype=kv_cache_dtype, num_heads=num_heads, **kw)


def measurement(k: DecisionKey, backend: str = "TRITON_MLA", *, batch_size: int = 8,
                kv_len: int = 4096, ok: bool = True, median_ms: float = 0.125) -> Measurement:
    if ok:
        return Measurement(key=k, backend=backend, batch_size=batch_size, kv_len=kv_len, status="ok",
                           median_ms=median_ms, ci_low_ms=median_ms * 0.99, ci_high_ms=median_ms * 1.01,
                           samples=50, rel_error=1.5e-3, gpu_uuid=H100.uuid, sm_clock_mhz_before=1980,
                           sm_clock_mhz_after=1965, temperature_c_before=41, temperature_c_after=48,
                           measured_at="2026-11-22T03:00:00.000+00:00")
    return Measurement(key=k, backend=backend, batch_size=batch_size, kv_len=kv_len, status="failed",
                       reason="CUDA error: an illegal memory access was encountered",
                       gpu_uuid=H100.uuid, measured_at="2026-11-22T03:00:01.000+00:00")


def decision(k: DecisionKey, winner: str = "FLASHINFER_FA3_MLA", *, fingerprint: SoftwareFingerprint = FP,
             decided_at: str = "2026-11-22T03:05:00.000+00:00") -> Decision:
    return Decision(key=k, winner=winner, static_choice="FLASHMLA",
                    scores={winner: 1.0, "FLASHMLA": 1.0625, "TRITON_MLA": 1.8},
                    runner_up="FLASHMLA", margin=0.0625, static_score=1.0625, noise_margin=0.02,
                    kept_static=False,
                    per_shape=(ShapeWinner(1, 1024, winner, 0.0213), ShapeWinner(64, 32768, "FLASHMLA", 0.75)),
                    anomalies=("FLASHINFER_MLA_SPARSE at 64 heads is 1.9x its trend",),
                    failures={"CUTLASS_MLA": "compute capability 9.0 not in {10.0, 10.3}"},
                    fingerprint=fingerprint, gpu_uuids=(H100.uuid, H100_B.uuid), decided_at=decided_at)


def file_digest(path: str) -> str | None:
    """sha256 of a file's bytes (None when absent): "left untouched" means this does not change."""
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def dump(url: str) -> dict[str, list[tuple]]:
    """Every row of every mla-tune table, sorted: "nothing half-written" compares these."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    from mla_tune.store.engine import resolve_url

    engine = create_engine(resolve_url(url), poolclass=NullPool)
    out = {}
    try:
        with engine.connect() as connection:
            for table in ("devices", "fingerprints", "runs", "measurements", "decisions", "alembic_version"):
                rows = connection.execute(text(f"SELECT * FROM {table}")).all()
                out[table] = sorted((tuple(str(v) for v in row) for row in rows))
    finally:
        engine.dispose()
    return out
