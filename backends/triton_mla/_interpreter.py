"""Compatibility fixes for Triton's CPU interpreter (`TRITON_INTERPRET=1`) on NumPy >= 2.4 and Triton >= 3.9.

Triton 3.6's interpreter represents a scalar as a 1-element array and converts
it with `int(array)` when a scalar tensor bounds a `range` loop; NumPy 2.4
removed that conversion for arrays with ndim > 0 ("only 0-dimensional arrays
can be converted to Python scalars"). Every kernel with a data-dependent loop
bound, ours included, then fails on CPU. `apply()` re-registers `__index__`
with an explicit `.item()`.

The interpreter types a comparison's result with its operands' type (int32 for
`pid < n`), so splatting a scalar comparison onto a block (`row_ok & (pid < n)`)
fills an int32 array; Triton 3.9's native load/store reject a mask that is not
bool ("mask has unsupported dtype"), where 3.7 converted it. `apply()` makes an
int1 splat bool. Both fixes only touch the interpreter and only when it is on.
"""

from __future__ import annotations

import os


def apply() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
        return
    import triton.language as tl
    from triton.runtime import interpreter

    splat = interpreter.InterpreterBuilder.create_splat
    if not getattr(splat, "_mla_tune_fixed", False):
        def create_splat(self, ret_ty, arg):
            out = splat(self, ret_ty, arg)
            return interpreter.TensorHandle(out.data.astype(bool), tl.int1) if ret_ty.scalar == tl.int1 else out

        create_splat._mla_tune_fixed = True
        interpreter.InterpreterBuilder.create_splat = create_splat

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_mla_tune_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._mla_tune_fixed = True
    interpreter._patch_lang_tensor = patched
