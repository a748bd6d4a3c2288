"""mla-tune's Triton MLA decode kernels (dense and top-k sparse; BF16, FP16 and FP8 e4m3 KV).

Importing this package imports torch and triton; `mla_tune` itself never does.
"""

from mla_tune.backends.triton_mla import _interpreter
from mla_tune.backends.triton_mla.decode import mla_decode
from mla_tune.backends.triton_mla.launch import PARAM_SPACE, LaunchParams, default_params

_interpreter.apply()

__all__ = ["mla_decode", "LaunchParams", "PARAM_SPACE", "default_params"]
