"""vLLM's own MLA priority rule, run from an installed vLLM's source text without importing vLLM.

`vllm.platforms.cuda` cannot be imported on a machine without libcuda, so the
functions are taken from the installed files with `ast` and executed on their own:

- `_get_backend_priorities` from `vllm/platforms/cuda.py`, its decorator and its one
  import (`is_quantized_kv_cache`) removed;
- `KVQuantMode`, `get_kv_quant_mode` and `is_quantized_kv_cache` from
  `vllm/v1/kv_cache_interface.py`, the import of the custom-dtype handler lookup
  replaced by "no handler" (a fresh vLLM process has none registered);
- `CacheDType` from `vllm/config/cache.py`.

Only the backend enum is a stand-in: `AttentionBackendEnum.X` evaluates to the
name "X", which is all the comparison needs. Any other change in what the
function reads makes `load` fail loudly rather than compare something else.
"""

from __future__ import annotations

import __future__
import ast
import importlib.util
import os
import typing
from collections import namedtuple
from enum import Enum, IntEnum
from pathlib import Path

PACKAGE_ENV = "MLA_TUNE_VLLM_PACKAGE"   # a vllm package directory, for a vLLM living in another environment

# The grid both comparisons walk: every branch of the rule and the values around its thresholds.
MAJORS = (7, 8, 9, 10, 11, 12, 13)
MINORS = (0, 3)
HEADS = (None, 1, 2, 4, 8, 15, 16, 17, 32, 64, 128)
HEAD_SIZES = (None, 64, 128, 256, 511, 512, 513, 576, 1024)
MLA_TUNE_SPELLINGS = ("bf16", "fp16", "half", "fp8_e4m3fn", "fp8_e4m3_per_token_head")


def package_dir() -> Path | None:
    """The installed vllm package directory (`$MLA_TUNE_VLLM_PACKAGE`, else this environment's), or None."""
    if os.environ.get(PACKAGE_ENV):
        return Path(os.environ[PACKAGE_ENV])
    spec = importlib.util.find_spec("vllm")   # locates the top-level package without running it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def version(package: Path) -> str:
    """`__version__` as written in the package's `_version.py`."""
    for node in ast.parse((package / "_version.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"no __version__ in {package / '_version.py'}")


class _Names:
    def __getattr__(self, name: str) -> str:
        return name


def _top_level(tree: ast.Module, name: str) -> ast.stmt:
    found = [n for n in tree.body if getattr(n, "name", None) == name
             or (isinstance(n, ast.Assign) and any(getattr(t, "id", None) == name for t in n.targets))]
    if len(found) != 1:
        raise LookupError(f"expected one top-level {name}, found {len(found)}")
    return found[0]


def _drop_import(function: ast.FunctionDef, module: str, name: str) -> None:
    """Remove the one `from module import name` in the function's body; fail if it is not there."""
    kept = [s for s in function.body if not (isinstance(s, ast.ImportFrom) and s.module == module
                                             and [a.name for a in s.names] == [name])]
    if len(kept) != len(function.body) - 1:
        raise LookupError(f"{function.name} no longer imports exactly `from {module} import {name}`")
    module = ast.Module(body=kept, type_ignores=[])
    imports = [s for s in ast.walk(module) if isinstance(s, ast.Import | ast.ImportFrom)]
    if imports:
        raise LookupError(f"{function.name} imports more than expected: {ast.unparse(imports[0])}")
    function.body = kept


def load(package: Path):
    """(vLLM's `_get_backend_priorities`, its `is_quantized_kv_cache`, its `CacheDType` values) from source."""
    cuda = ast.parse((package / "platforms" / "cuda.py").read_text())
    priorities = _top_level(cuda, "_get_backend_priorities")
    priorities.decorator_list = []
    _drop_import(priorities, "vllm.v1.kv_cache_interface", "is_quantized_kv_cache")

    kv = ast.parse((package / "v1" / "kv_cache_interface.py").read_text())
    quant_mode = _top_level(kv, "get_kv_quant_mode")
    _drop_import(quant_mode, "vllm.config.cache", "get_kv_cache_dtype_handler")
    body = [_top_level(kv, "KVQuantMode"), quant_mode, _top_level(kv, "is_quantized_kv_cache"), priorities]

    cache = ast.parse((package / "config" / "cache.py").read_text())
    body.append(_top_level(cache, "CacheDType"))

    namespace = {"IntEnum": IntEnum, "Enum": Enum, "Literal": typing.Literal, "__name__": "vllm_source",
                 "AttentionBackendEnum": _Names(), "get_kv_cache_dtype_handler": lambda name: None}
    module = ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))
    # cuda.py has `from __future__ import annotations`: its annotations name modules that are absent here.
    exec(compile(module, str(package), "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True),
         namespace)
    return namespace["_get_backend_priorities"], namespace["is_quantized_kv_cache"], \
        typing.get_args(namespace["CacheDType"])


DeviceCapability = namedtuple("DeviceCapability", "major minor")


def grid(cache_dtypes):
    """Every (major, minor, kv spelling, heads, head_size) the comparisons check."""
    for major in MAJORS:
        for minor in MINORS:
            for dtype in (*cache_dtypes, *MLA_TUNE_SPELLINGS):
                for heads in HEADS:
                    for head_size in HEAD_SIZES:
                        yield major, minor, dtype, heads, head_size
