"""Which of our backend names each serving engine runs under a name of its own, and the best of them.

A backend counts for an engine only when the kernel we timed under that name is the kernel the engine
runs under it (the registry's `vllm_name` / `sglang_name`). Our own kernels reach vLLM through our
plugin under `vllm_plugin_name`; they count only where that plugin is installed, which the caller says.

Pure functions of registry data: no torch, no store.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from mla_tune.backends.registry import BACKENDS

ENGINES = ("vllm", "sglang")


def check_engine(engine: str) -> str:
    """The engine's canonical name; ValueError for an unknown one."""
    name = str(engine).strip().lower()
    if name not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    return name


def engine_name(backend: str, engine: str, *, with_plugin: bool = False) -> str | None:
    """The engine's name for our `backend`, or None when the engine does not run it.

    Args:
        backend: our backend name.
        engine: "vllm" or "sglang".
        with_plugin: also count the names our vLLM plugin registers (only where it is installed).

    Raises:
        ValueError: unknown engine or backend name.
    """
    engine = check_engine(engine)
    info = BACKENDS.get(str(backend).strip().upper())
    if info is None:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(sorted(BACKENDS))}")
    if engine == "sglang":
        return info.sglang_name
    plugin = getattr(info, "vllm_plugin_name", None) if with_plugin else None
    return info.vllm_name or plugin


def rank_for_engine(scores: Mapping[str, float], engine: str, *,
                    with_plugin: bool = False) -> list[tuple[str, str, float]]:
    """(ours, engine's name, score) for every scored backend the engine runs, best first.

    Ties break on our name so that every rank of a cluster reads the same order. Unknown names and
    non-finite scores are ignored.
    """
    engine = check_engine(engine)
    ranked = []
    for backend, score in scores.items():
        if backend not in BACKENDS or not isinstance(score, (int, float)) or not math.isfinite(score):
            continue
        mapped = engine_name(backend, engine, with_plugin=with_plugin)
        if mapped:
            ranked.append((backend, mapped, float(score)))
    return sorted(ranked, key=lambda row: (row[2], row[0]))


def engine_best(scores: Mapping[str, float]) -> dict[str, str]:
    """{engine: the best-scoring backend it runs under its own name}, for engines that run any scored one."""
    best = {}
    for engine in ENGINES:
        ranked = rank_for_engine(scores, engine)
        if ranked:
            best[engine] = ranked[0][0]
    return best


def vllm_regret(decision) -> str:
    """How far vLLM's fastest own backend is from the fastest kernel, and vLLM's static choice from it,
    for one decision: e.g. "FLASHMLA, 1.30x MLA_TUNE_TRITON; static FLASH_ATTN_MLA 1.05x". "-" when the
    decision never timed vLLM's kernels."""
    best = (decision.engine_best or {}).get("vllm")
    if not best or best not in decision.scores:
        return "not timed" if decision.engine_best is None else "-"
    scores = decision.scores
    fastest = min(scores, key=lambda b: (scores[b], b))
    text = best if fastest == best else f"{best}, {scores[best] / scores[fastest]:.2f}x {fastest}"
    static = decision.static_choice
    if static and static != best:
        text += (f"; static {static} {scores[static] / scores[best]:.2f}x" if static in scores
                 else f"; static {static} not timed")
    return text
