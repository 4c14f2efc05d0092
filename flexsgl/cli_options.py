"""The command line's engine flags, made from EngineConfig's fields: one flag per field (its name with
dashes, its type, its help), the deprecated names as hidden flags, and `--log-level`.

    @app.command()
    @engine_options
    def generate(prompts: list[str] = ..., *, engine: EngineConfig): ...

The decorated command receives the flags as one checked `engine: EngineConfig`; a bad value ends
the command with one `error: ...` line and exit code 2.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import fields
from typing import Optional

import click
import typer
from typer.core import TyperCommand

from flexsgl.config import DEPRECATED, EngineConfig
from flexsgl.log import LEVELS, set_level

# A field's annotation (a string under `from __future__ import annotations`) -> the type typer parses.
CLI_TYPES = {"str": str, "str | None": Optional[str], "int": int, "int | None": Optional[int], "float": float,
             "bool": bool, "bool | None": Optional[bool], "tuple[int, ...] | None": Optional[str],
             "object": Optional[str]}


try:  # newer typers parse with a click of their own
    from typer._click.exceptions import NoSuchOption as _TyperNoSuchOption
except ImportError:
    _TyperNoSuchOption = click.NoSuchOption
NO_SUCH_OPTION = (click.NoSuchOption, _TyperNoSuchOption)


class Command(TyperCommand):
    """A command whose suggestions for a mistyped flag leave out the hidden (deprecated) flags."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except NO_SUCH_OPTION as e:
            hidden = {o for p in self.params if getattr(p, "hidden", False) for o in (*p.opts, *p.secondary_opts)}
            e.possibilities = [o for o in e.possibilities or () if o not in hidden]
            raise


def fail(message: str, code: int = 2) -> None:
    """One `error: ...` line and the exit code: 2 for bad input, 1 for a fault."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


# Other names a flag also answers to (SGLang's --tp-size, and --tp; vLLM's --max-model-len).
ALIASES = {"tensor_parallel_size": ("--tp-size", "--tp"), "context_length": ("--max-model-len",)}


def _flag(name: str, kind, default, help: str, hidden: bool = False) -> inspect.Parameter:
    dashed = "--" + name.replace("_", "-")
    decls = [f"{dashed}/--no-{dashed[2:]}"] if kind == Optional[bool] else [dashed, *ALIASES.get(name, ())]
    opt = typer.Option(default, *decls, help=help, hidden=hidden, show_default=default is not None)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=kind)


def _engine_flags(exclude: tuple[str, ...], own: set[str]) -> list[inspect.Parameter]:
    by_name = {f.name: f for f in fields(EngineConfig)}
    flags = [_flag(f.name, CLI_TYPES[f.type], None if f.type == "tuple[int, ...] | None" else f.default,
                   f.metadata["help"]) for f in by_name.values() if f.name not in exclude]
    for old, (new, _) in DEPRECATED.items():
        if old in own:  # the command's own flag of that name wins (generate's --seed samples)
            continue
        kind = Optional[bool] if old == "cuda_graphs" else Optional[CLI_TYPES[by_name[new].type]]
        flags.append(_flag(old, kind, None, f"Deprecated: use --{new.replace('_', '-')}.", hidden=True))
    flags.append(_flag("log_level", Optional[str], None, f"Log level: {', '.join(LEVELS)} (default: "
                       "$FLEXSGL_LOG_LEVEL, else info)."))
    return flags


def _batch_sizes(text: str) -> tuple:
    try:
        return tuple(int(b) for b in text.split(","))
    except ValueError:
        fail(f"--cuda-graph-bs {text!r} should be batch sizes separated by commas, e.g. 1,2,4,8.")


def engine_options(command=None, *, exclude: tuple[str, ...] = ()):
    """Give `command` a flag per engine option (but those in `exclude`, which the command defines
    itself); it is called with `engine=EngineConfig(...)` holding every option but those."""
    if command is None:
        return functools.partial(engine_options, exclude=exclude)
    own = [p for p in inspect.signature(command).parameters.values() if p.name != "engine"]
    flags = _engine_flags(exclude, {p.name for p in own})
    names = [p.name for p in flags]

    @functools.wraps(command)
    def wrapper(**kwargs):
        values = {name: kwargs.pop(name) for name in names}
        try:
            set_level(values.pop("log_level"))
        except ValueError as e:
            fail(str(e))
        for name in ("cuda_graph_bs", "graph_batch_sizes"):
            if values[name] is not None:
                values[name] = _batch_sizes(values[name])
        for old in DEPRECATED:  # a hidden old flag counts only when given
            if old in values and values[old] is None:
                del values[old]
        for old, (new, _) in DEPRECATED.items():
            if old in values:
                typer.echo(f"warning: --{old.replace('_', '-')} is deprecated; use --{new.replace('_', '-')}.", err=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # said above, in the flags' own names
            try:
                engine = EngineConfig.from_options(**values)
            except ValueError as e:
                fail(str(e))
        return command(engine=engine, **kwargs)

    wrapper.__signature__ = inspect.Signature(own + flags)
    wrapper.__annotations__ = {p.name: p.annotation for p in own + flags}
    return wrapper
