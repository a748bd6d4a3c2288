"""mla-tune's Triton MLA decode kernels (dense and top-k sparse; BF16, FP16 and FP8 e4m3 KV).

Importing this package imports torch and triton; `mla_tune` itself never does. docs/kernels.md describes the
kernels, their forms and the dispatch table; the modules:

- `config`: `LaunchParams`, `Tile` and the launch shapes; `dispatch`: every dispatch table and the default choice;
- `splits`: the split model; `workspace`: the split partials; `launcher`: enqueues the kernels;
- `tl_kernel`, `combine`: the portable kernels; `hopper*`: the warp-specialised Hopper kernel and its forms;
- `decode`: `mla_decode`, the one-call entry point; `adapter`: the tuner's backends.
"""

from mla_tune.backends.triton_mla import _interpreter
from mla_tune.backends.triton_mla.config import PARAM_SPACE, LaunchParams, Tile
from mla_tune.backends.triton_mla.decode import mla_decode
from mla_tune.backends.triton_mla.splits import default_params

_interpreter.apply()

__all__ = ["mla_decode", "LaunchParams", "PARAM_SPACE", "Tile", "default_params"]
