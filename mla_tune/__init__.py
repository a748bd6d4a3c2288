"""mla-tune: measured MLA attention backend choice for serving engines.

`import mla_tune` is cheap: it loads no torch, triton or flashinfer, and the
lookup machinery is imported on first use of any name in `__all__`.
"""

__version__ = "0.1.0"

__all__ = ["Choice", "NoDeviceError", "NoEligibleBackendError", "TileChoice", "clear_cache", "kernel_tile", "lookup",
           "static_priority", "__version__"]

_RUNTIME_NAMES = ("lookup", "Choice", "NoDeviceError", "NoEligibleBackendError", "clear_cache")


def __getattr__(name):
    if name in _RUNTIME_NAMES:
        from mla_tune import runtime

        globals()[name] = getattr(runtime, name)
        return globals()[name]
    if name in ("kernel_tile", "TileChoice"):
        from mla_tune import tiles

        globals()[name] = getattr(tiles, name)
        return globals()[name]
    if name == "static_priority":
        from mla_tune.backends.priority import static_priority

        return static_priority
    raise AttributeError(f"module 'mla_tune' has no attribute {name!r}")
