"""Our backend names mapped to each serving engine's, and the best backend an engine has.

The mapping is data: the registry's `vllm_name` and `sglang_name` fields
(`mla_tune.backends.registry.BACKENDS`). This module reads them, renders the
table for the docs, and ranks the stored scores of a decision by engine, so a
lookup can answer "the fastest backend vLLM can actually run" when the overall
winner is one of ours (for example `FLASHINFER_FA3_MLA`, which vLLM has no
name for).

The table itself is in docs/fleet.md (a test keeps it equal to
`engine_table_markdown()`).

Importing this module loads no torch, triton or flashinfer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mla_tune.backends.registry import BACKENDS

ENGINES = ("vllm", "sglang")
_ENGINE_TITLES = {"vllm": "vLLM", "sglang": "SGLang"}


def _check_engine(engine: str) -> str:
    name = str(engine).strip().lower()
    if name not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    return name


def engine_name(backend: str, engine: str) -> str | None:
    """The engine's own name for our `backend`, or None when the engine does not have it.

    Raises:
        ValueError: unknown engine or backend name.
    """
    engine = _check_engine(engine)
    info = BACKENDS.get(str(backend).strip().upper())
    if info is None:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(sorted(BACKENDS))}")
    return info.vllm_name if engine == "vllm" else info.sglang_name


def engine_backends(engine: str) -> dict[str, str]:
    """{our name: engine's name} for every backend `engine` has, in registry order."""
    return {name: mapped for name in BACKENDS if (mapped := engine_name(name, engine))}


def engine_table() -> list[tuple[str, str | None, str | None]]:
    """Rows (ours, vLLM name, SGLang name) for every registry entry that may win."""
    return [(name, info.vllm_name, info.sglang_name)
            for name, info in BACKENDS.items() if info.capabilities.candidate]


def engine_table_markdown() -> str:
    """The mapping as a Markdown table ("-" where the engine has no such backend)."""
    lines = ["| ours | vLLM `--attention-backend` | SGLang `--attention-backend` |",
             "|---|---|---|"]
    for ours, vllm, sglang in engine_table():
        lines.append(f"| `{ours}` | {f'`{vllm}`' if vllm else '-'} | {f'`{sglang}`' if sglang else '-'} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class EngineChoice:
    """The backend to hand an engine, and why.

    Attributes:
        backend: our name, or None when the engine has none of the scored backends.
        engine_backend: the engine's name for it (what goes after `--attention-backend`).
        score: its stored score (1.0 = best at every shape), None when not scored.
        basis: "winner" (the decision's winner, which the engine has), "ranked" (the
            best-scoring backend among those the engine has), "static" (the static
            choice, not measured but known to the engine), or "none".
        reason: one sentence for people.
    """

    engine: str
    backend: str | None
    engine_backend: str | None
    score: float | None
    basis: str
    reason: str


def rank_for_engine(scores: Mapping[str, float], engine: str) -> list[tuple[str, str, float]]:
    """(ours, engine's name, score) for every scored backend the engine has, best first.

    Ties break on our name so that every rank of a cluster reads the same order.
    Unknown names and non-finite scores are ignored.
    """
    engine = _check_engine(engine)
    ranked = []
    for backend, score in scores.items():
        info = BACKENDS.get(backend)
        if info is None or score is None or not (score == score) or score == float("inf"):
            continue
        mapped = info.vllm_name if engine == "vllm" else info.sglang_name
        if mapped:
            ranked.append((backend, mapped, float(score)))
    return sorted(ranked, key=lambda row: (row[2], row[0]))


def choose_for_engine(*, winner: str, scores: Mapping[str, float], engine: str,
                      static_choice: str | None = None) -> EngineChoice:
    """Pick the backend to give `engine` from one decision's winner and stored scores.

    Args:
        winner: the decision's winner (our name).
        scores: backend -> score (weighted geometric mean of time / per-shape best).
        engine: "vllm" or "sglang".
        static_choice: vLLM's static-priority choice for the key, used only when
            none of the engine's backends was scored.
    """
    engine = _check_engine(engine)
    title = _ENGINE_TITLES[engine]
    mapped = engine_name(winner, engine) if winner in BACKENDS else None
    if mapped:
        return EngineChoice(engine, winner, mapped, scores.get(winner), "winner",
                            f"{title} has the tuned winner {winner} as {mapped}.")
    ranked = rank_for_engine(scores, engine)
    if ranked:
        best, best_mapped, score = ranked[0]
        return EngineChoice(engine, best, best_mapped, score, "ranked",
                            f"{title} has no backend for the tuned winner {winner}; the best-scoring "
                            f"backend it has is {best} (score {score:.3f} against {scores.get(winner, 1.0):.3f}).")
    if static_choice and static_choice in BACKENDS and engine_name(static_choice, engine):
        return EngineChoice(engine, static_choice, engine_name(static_choice, engine), None, "static",
                            f"{title} has none of the measured backends "
                            f"({', '.join(sorted(scores)) or 'none'}); keeping its static choice {static_choice}.")
    return EngineChoice(engine, None, None, None, "none",
                        f"{title} has none of the measured backends ({', '.join(sorted(scores)) or 'none'}) "
                        f"and no static choice is known; let the engine choose.")


def decision_for_engine(decision, engine: str) -> EngineChoice:
    """`choose_for_engine` applied to a stored `Decision`."""
    return choose_for_engine(winner=decision.winner, scores=decision.scores, engine=engine,
                             static_choice=decision.static_choice)


def choice_for_engine(choice, engine: str) -> EngineChoice:
    """What to hand `engine` for a `mla_tune.Choice`: the tuned winner, the best backend the
    engine has by stored score, or, for a fallback answer, vLLM's static choice."""
    engine = _check_engine(engine)
    if choice.source != "tuned":
        mapped = engine_name(choice.backend, engine)
        return EngineChoice(engine, choice.backend if mapped else None, mapped, None, "static",
                            f"nothing tuned; the static choice is {choice.backend}"
                            + ("" if mapped else f", which {_ENGINE_TITLES[engine]} does not have") + ".")
    return choose_for_engine(winner=choice.backend, scores=dict(choice.scores), engine=engine,
                             static_choice=choice.static_choice)
