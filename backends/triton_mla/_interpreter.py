"""A compatibility fix for Triton's CPU interpreter (`TRITON_INTERPRET=1`) on NumPy >= 2.4.

Triton 3.6's interpreter represents a scalar as a 1-element array and converts
it with `int(array)` when a scalar tensor bounds a `range` loop; NumPy 2.4
removed that conversion for arrays with ndim > 0 ("only 0-dimensional arrays
can be converted to Python scalars"). Every kernel with a data-dependent loop
bound, ours included, then fails on CPU. `apply()` re-registers `__index__`
with an explicit `.item()`; it only touches the interpreter and only when the
interpreter is on.
"""

from __future__ import annotations

import os


def apply() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
        return
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_mla_tune_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._mla_tune_fixed = True
    interpreter._patch_lang_tensor = patched
