"""What to hand a serving engine: the fastest backend it runs under its own name, never another kernel.

A decision keeps the fastest kernel overall (`winner`) and, per engine, the fastest backend whose timed
kernel is the one the engine runs under that name (`Decision.engine_best`, from the registry's
`vllm_name` / `sglang_name`). Our own kernels reach vLLM only through our plugin, so they are handed to
vLLM only where the plugin is installed, and only when the launch the plugin makes (timed by the tuner,
`Decision.plugin_scores`) beats vLLM's fastest own backend. The name mapping is data in the registry;
docs/fleet.md shows it (a test keeps it equal to `engine_table_markdown()`).

Importing this module loads no torch, triton or flashinfer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mla_tune.backends.engine_names import ENGINES, check_engine, engine_name, plugin_only, rank_for_engine
from mla_tune.backends.registry import BACKENDS

__all__ = ["ENGINES", "EngineChoice", "choice_for_engine", "choose_for_engine", "decision_for_engine",
           "engine_backends", "engine_name", "engine_table", "engine_table_markdown", "rank_for_engine",
           "vllm_plugin_missing"]

_TITLES = {"vllm": "vLLM", "sglang": "SGLang"}


def engine_backends(engine: str) -> dict[str, str]:
    """{our name: engine's name} for every backend `engine` runs under its own name, in registry order."""
    return {name: mapped for name in BACKENDS if (mapped := engine_name(name, engine))}


def engine_table() -> list[tuple[str, str | None, str | None]]:
    """Rows (ours, vLLM name, SGLang name) for every registry entry that may win; the vLLM column gives
    the plugin's name for our own kernels."""
    return [(name, engine_name(name, "vllm", with_plugin=True), info.sglang_name)
            for name, info in BACKENDS.items() if info.capabilities.candidate]


def engine_table_markdown() -> str:
    """The mapping as a Markdown table ("-" where the engine has no such backend)."""
    lines = ["| ours | vLLM `--attention-backend` | SGLang `--attention-backend` |",
             "|---|---|---|"]
    for ours, vllm, sglang in engine_table():
        plugin = " (mla-tune's vLLM plugin)" if plugin_only(ours, "vllm") else ""
        lines.append(f"| `{ours}` | {f'`{vllm}`{plugin}' if vllm else '-'} | {f'`{sglang}`' if sglang else '-'} |")
    return "\n".join(lines)


def vllm_plugin_missing() -> str | None:
    """Why mla-tune's vLLM plugin cannot serve our kernels in this environment, or None when it can.

    Run it in the engine's environment (its image, its virtual environment); the operator's opt-in
    (`MLA_TUNE_VLLM_PLUGIN=1`) belongs to the engine's shell, so it is not held against this one.
    """
    from mla_tune.vllm_plugin import plugin_status

    status = plugin_status(check_opt_in=False)
    return None if status.can_serve else "; ".join(status.reasons)


def plugin_refusals(backend: str, key: Mapping | None) -> list[str]:
    """Why our vLLM backend for `backend` cannot serve a decision key (`DecisionKey.to_dict()` form), in
    our vLLM backend's own terms (`mla_tune.vllm_backends.capabilities`); empty when it can or `key` is None."""
    if key is None:
        return []
    from mla_tune.vllm_backends.capabilities import BACKENDS as PLUGIN_BACKENDS, refusal_reasons, vllm_dtype

    caps = PLUGIN_BACKENDS.get(engine_name(backend, "vllm", with_plugin=True) or "")
    if caps is None:
        return [f"mla-tune's vLLM plugin has no backend for {backend}"]
    kv = str(key.get("kv_cache_dtype", ""))
    rank, rope = (int(x) for x in str(key.get("geometry", "512/64")).split("/")[:2])
    major, _, minor = str(key.get("compute_capability", "")).partition(".")
    return refusal_reasons(caps, sparse=bool(key.get("topk")), kv_cache_dtype=vllm_dtype(kv),
                           model_dtype=None if key.get("query_dtype") is None else vllm_dtype(str(key["query_dtype"])),
                           num_heads=key.get("num_heads"), block_size=key.get("page_size"),
                           head_size=rank + rope, kv_lora_rank=rank,
                           capability=(int(major), int(minor)) if major.isdigit() and minor.isdigit() else None)


@dataclass(frozen=True)
class EngineChoice:
    """The backend to hand an engine, and why.

    Attributes:
        engine: "vllm" or "sglang".
        backend: our name, or None when nothing tuned can be handed to the engine.
        engine_backend: the engine's name for it (what goes after `--attention-backend`).
        score: its stored score (1.0 = best at every shape), None when not scored.
        basis: "winner" (the fastest kernel overall, which the engine runs), "engine_best" (the fastest
            backend the engine runs, slower than the overall winner), "static" (nothing tuned: the engine
            chooses), "stale" (the decision never timed the engine's own kernels) or "none".
        reason: one sentence for people, with how far this is from the fastest kernel and from the
            engine's static choice.
    """

    engine: str
    backend: str | None
    engine_backend: str | None
    score: float | None
    basis: str
    reason: str


def _versus_static(title: str, backend: str, score: float, static_choice: str | None,
                   scores: Mapping[str, float]) -> str:
    static = scores.get(static_choice) if static_choice else None
    if not static_choice or static_choice == backend:
        return f"; it is also {title}'s static choice" if static_choice else ""
    if static is None:
        return f"; {title}'s static choice {static_choice} was not timed"
    return f"; {title}'s static choice {static_choice} takes {static / score:.2f}x its time"


def choose_for_engine(*, winner: str, scores: Mapping[str, float], engine: str,
                      engine_best: Mapping[str, str] | None, static_choice: str | None = None,
                      plugin_missing: str | None = "not checked", key: Mapping | None = None,
                      plugin_scores: Mapping[str, float] | None = None) -> EngineChoice:
    """Pick the backend to hand `engine` from one tuned decision.

    Args:
        winner: the decision's fastest kernel overall (our name).
        scores: backend -> score (weighted geometric mean of time / per-shape best; 1.0 = best).
        engine: "vllm" or "sglang".
        engine_best: the decision's {engine: backend}; None for a decision that never timed the engines'
            own kernels, which is then never handed to an engine.
        static_choice: vLLM's static choice for the key, for the reason's comparison.
        plugin_missing: why mla-tune's vLLM plugin cannot serve our kernels where the engine runs, None
            when it can (see `vllm_plugin_missing`).
        key: the decision key (`DecisionKey.to_dict()` form): our kernel goes to vLLM only where our vLLM
            backend can run that key as it was timed (`plugin_refusals`).
        plugin_scores: the decision's {backend: score of the launch our vLLM backend makes of it}; our kernel
            goes to vLLM only when that score is lower than vLLM's fastest own backend's. None for a decision
            that never timed that launch, which then never hands our kernel to vLLM.
    """
    engine = check_engine(engine)
    title = _TITLES[engine]
    if engine_best is None:
        return EngineChoice(engine, None, None, None, "stale",
                            f"the tuned decision was made before mla-tune timed {title}'s own kernels (its "
                            f"{winner} may not be the kernel {title} runs under that name); re-run `mla-tune` "
                            f"to tune again; {title} makes its own choice")
    plugin_name = engine_name(winner, engine, with_plugin=True)
    if not plugin_only(winner, engine):
        return _engine_own(engine, winner=winner, scores=scores, engine_best=engine_best,
                           static_choice=static_choice, why_not_ours="")
    if plugin_missing is None:
        plugin_missing = "; ".join(plugin_refusals(winner, key)) or None
    if plugin_missing is not None:
        return _engine_own(engine, winner=winner, scores=scores, engine_best=engine_best, static_choice=static_choice,
                           why_not_ours=f" ({winner} cannot go to vLLM here: {plugin_missing})")
    own = engine_best.get(engine)
    ours, own_score = (plugin_scores or {}).get(winner), scores.get(own) if own else None
    if ours is not None and (own_score is None or ours < own_score):
        versus = f"; vLLM's fastest own backend {own} {own_score:.2f}x" if own_score is not None else ""
        return EngineChoice(engine, winner, plugin_name, ours, "winner",
                            f"the fastest kernel {winner} runs in vLLM through mla-tune's plugin as {plugin_name}, "
                            f"and as vLLM launches it takes {ours:.2f}x the time of the fastest kernel{versus}"
                            + _versus_static(title, winner, ours, static_choice, scores))
    return _engine_own(engine, winner=winner, scores=scores, engine_best=engine_best, static_choice=static_choice,
                       why_not_ours=_why_not_ours(winner, plugin_scores=plugin_scores, ours=ours, own=own,
                                                  own_score=own_score))


def _why_not_ours(winner: str, *, plugin_scores: Mapping[str, float] | None, ours: float | None, own: str | None,
                  own_score: float | None) -> str:
    """Why our kernel, the fastest as the tuner launches it, does not go to vLLM through the plugin."""
    if plugin_scores is None:
        return (f" ({winner} goes to vLLM only where the tune timed it as vLLM launches it, and this decision "
                f"did not; re-run `mla-tune` to tune again)")
    if ours is None:
        return (f" ({winner} was not timed as vLLM launches it at every shape: its measurements' engine_reason "
                f"says why; where they have none, re-run `mla-tune tune --force`)")
    return (f" ({winner} as vLLM launches it takes {ours:.2f}x the time of the fastest kernel; "
            f"{own} {own_score:.2f}x)")


def _engine_own(engine: str, *, winner: str, scores: Mapping[str, float], engine_best: Mapping[str, str],
                static_choice: str | None, why_not_ours: str) -> EngineChoice:
    """The fastest backend `engine` runs under its own name (`engine_best`), with `why_not_ours` in the reason."""
    title = _TITLES[engine]
    best = engine_best.get(engine)
    if best is None or best not in BACKENDS or engine_name(best, engine) is None:
        return EngineChoice(engine, None, None, None, "none",
                            f"{title} runs none of the timed backends under its own name{why_not_ours}; {title} "
                            f"makes its own choice")
    score, fastest = scores.get(best), scores.get(winner)
    mapped = engine_name(best, engine)
    if best == winner:
        return EngineChoice(engine, best, mapped, score, "winner",
                            f"{title} runs the fastest kernel {best} as {mapped}"
                            + _versus_static(title, best, score or 1.0, static_choice, scores))
    ratio = f"{score / fastest:.2f}x" if score and fastest else "an unknown multiple of"
    return EngineChoice(engine, best, mapped, score, "engine_best",
                        f"{title}'s fastest own backend is {best}, {ratio} the time of the fastest kernel "
                        f"{winner}{why_not_ours}" + _versus_static(title, best, score or 1.0, static_choice, scores))


def decision_for_engine(decision, engine: str, *, plugin_missing: str | None = "not checked") -> EngineChoice:
    """`choose_for_engine` applied to a stored `Decision`."""
    return choose_for_engine(winner=decision.winner, scores=decision.scores, engine=engine,
                             engine_best=decision.engine_best, static_choice=decision.static_choice,
                             plugin_missing=plugin_missing, key=decision.key.to_dict(),
                             plugin_scores=decision.plugin_scores)


def choice_for_engine(choice, engine: str, *, plugin_missing: str | None = "not checked") -> EngineChoice:
    """What to hand `engine` for a `mla_tune.Choice`: for a tuned answer the fastest backend the engine
    runs (our kernel through the plugin where `plugin_missing` is None); for a fallback, nothing: the
    engine makes its own static choice, which is the fallback's answer."""
    engine = check_engine(engine)
    if choice.source != "tuned":
        return EngineChoice(engine, None, None, None, "static",
                            f"nothing tuned ({choice.why}); {_TITLES[engine]} makes its own choice "
                            f"(vLLM's static priority gives {choice.backend})")
    engine_best = None if choice.engine_best is None else dict(choice.engine_best)
    plugin_scores = None if choice.plugin_scores is None else dict(choice.plugin_scores)
    return choose_for_engine(winner=choice.backend, scores=dict(choice.scores), engine=engine,
                             engine_best=engine_best, static_choice=choice.static_choice,
                             plugin_missing=plugin_missing, key=dict(choice.key), plugin_scores=plugin_scores)
