"""Shared click options and parameter types: heads, KV-cache dtype, compute capability."""

from __future__ import annotations

import click

from mla_tune.backends.problem import normalize_kv_cache_dtype, normalize_query_dtype, parse_compute_capability


class KvCacheDtype(click.ParamType):
    """Any vLLM `--kv-cache-dtype` spelling or bf16/fp16; keeps the spelling (vLLM's priority reads it)."""

    name = "DTYPE"

    def convert(self, value, param, ctx):
        try:
            normalize_kv_cache_dtype(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        return value.strip().lower()


class QueryDtype(click.ParamType):
    name = "DTYPE"

    def convert(self, value, param, ctx):
        try:
            return normalize_query_dtype(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class ComputeCapability(click.ParamType):
    """`9.0` -> (9, 0)."""

    name = "X.Y"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            return parse_compute_capability(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


HEADS = click.IntRange(min=1, max=1024)
PAGE_SIZE = click.IntRange(min=1, max=4096)
TOPK = click.IntRange(min=1, max=1 << 20)


def problem_options(func=None, *, heads_required: bool):
    """--heads, --kv-cache-dtype, --sparse, --topk, --page-size, --query-dtype."""
    def decorate(f):
        options = [
            click.option("--heads", "num_heads", type=HEADS, required=heads_required,
                         default=None if heads_required else 128, show_default=not heads_required,
                         help="Query heads per rank (model heads / tensor parallelism)."),
            click.option("--kv-cache-dtype", "kv_cache_dtype", type=KvCacheDtype(),
                         required=heads_required, default=None if heads_required else "auto",
                         show_default=not heads_required,
                         help="KV-cache dtype: auto, bf16, fp16, fp8, fp8_e4m3, fp8_e5m2, fp8_ds_mla, ..."),
            click.option("--sparse", is_flag=True, help="A sparse (top-k) model such as DeepSeek-V3.2."),
            click.option("--topk", type=TOPK, default=None, help="Sparse top-k (default 2048; implies --sparse)."),
            click.option("--page-size", type=PAGE_SIZE, default=64, show_default=True,
                         help="KV-cache tokens per page."),
            click.option("--query-dtype", type=QueryDtype(), default="bf16", show_default=True,
                         help="Model (query) dtype: bf16 or fp16."),
        ]
        for option in reversed(options):
            f = option(f)
        return f
    return decorate(func) if func is not None else decorate


def _set_db(ctx: click.Context, _param, value: str | None) -> None:
    if value is not None:
        from mla_tune.cli.main import validated_db_url

        root = ctx.find_root()
        root.ensure_object(dict)
        root.obj["db"] = validated_db_url(value)


def db_option(func):
    """`--db URL` on a subcommand too (`mla-tune lookup --db URL ...`); it overrides the global one."""
    return click.option("--db", metavar="URL", expose_value=False, callback=_set_db,
                        help="SQLAlchemy URL of the decision store (as the global --db; env MLA_TUNE_DB).")(func)
