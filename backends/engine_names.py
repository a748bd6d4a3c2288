"""Which of our backend names each serving engine runs under a name of its own, and the best of them.

A backend counts for an engine only when the kernel we timed under that name is the kernel the engine
runs under it (the registry's `vllm_name` / `sglang_name`). Our own kernels reach vLLM through our
plugin under `vllm_plugin_name`; they count only where that plugin is installed, which the caller says.

Pure functions of registry data: no torch, no store.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

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


def plugin_only(backend: str, engine: str) -> bool:
    """Whether `engine` runs our `backend` only through mla-tune's plugin (our own kernels in vLLM); False for an
    unknown name."""
    info = BACKENDS.get(str(backend).strip().upper())
    return (info is not None and check_engine(engine) == "vllm" and not info.vllm_name
            and bool(getattr(info, "vllm_plugin_name", None)))


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


@dataclass(frozen=True)
class VllmGap:
    """One decision's distance between what vLLM gets and the fastest kernel, and vLLM's static choice.

    Attributes:
        fastest: the best-scoring backend overall.
        best: vLLM's fastest own backend (None: the decision never timed vLLM's kernels, or none was scored).
        best_over_fastest: its score over the fastest's (1.0 when it is the fastest).
        static: vLLM's static choice for the key.
        static_over_best: the static choice's score over vLLM's best (None when either was not timed).
        plugin: the fastest backend when vLLM runs it only through mla-tune's plugin (our kernel), else None.
        plugin_over_fastest: the score of the launch the plugin makes of it over the fastest's score (None when
            that launch was not timed at every shape).
    """

    fastest: str
    best: str | None
    best_over_fastest: float | None
    static: str | None
    static_over_best: float | None
    plugin: str | None = None
    plugin_over_fastest: float | None = None


def vllm_gap(decision) -> VllmGap | None:
    """The `VllmGap` of a decision; None when it scored nothing."""
    scores = decision.scores
    if not scores:
        return None
    fastest = min(scores, key=lambda b: (scores[b], b))
    best = (decision.engine_best or {}).get("vllm")
    best = best if best in scores else None
    static = decision.static_choice
    plugin = fastest if plugin_only(fastest, "vllm") else None
    plugin_score = (getattr(decision, "plugin_scores", None) or {}).get(plugin) if plugin else None
    return VllmGap(fastest, best, scores[best] / scores[fastest] if best else None, static,
                   scores[static] / scores[best] if best and static in scores else None, plugin,
                   plugin_score / scores[fastest] if plugin_score is not None else None)


def vllm_regret(decision) -> str:
    """`vllm_gap` in words for one decision, e.g. "FLASH_ATTN_MLA, 1.22x MLA_TUNE_TRITON; MLA_TUNE_TRITON as vLLM
    launches it 1.36x" (with "; static X Nx" where vLLM's static choice is another backend); "not timed" when
    the decision never timed vLLM's kernels."""
    gap = vllm_gap(decision)
    if gap is None or gap.best is None:
        return "not timed" if decision.engine_best is None else "-"
    text = gap.best if gap.best == gap.fastest else f"{gap.best}, {gap.best_over_fastest:.2f}x {gap.fastest}"
    if gap.static and gap.static != gap.best:
        text += (f"; static {gap.static} {gap.static_over_best:.2f}x" if gap.static_over_best is not None
                 else f"; static {gap.static} not timed")
    if gap.plugin:
        text += (f"; {gap.plugin} as vLLM launches it {gap.plugin_over_fastest:.2f}x"
                 if gap.plugin_over_fastest is not None else f"; {gap.plugin} as vLLM launches it not timed")
    return text
