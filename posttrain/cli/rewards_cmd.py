"""``rl-cli rewards try NAME --response TEXT --label TEXT [key=value ...]``: score one response, see why."""

from __future__ import annotations

import json

import typer

from posttrain.cli.console import console
from posttrain.cli.options import Disabled, PluginFiles, load
from posttrain.core.errors import ConfigError, UsageError

app = typer.Typer(help="Debug reward functions.", no_args_is_help=True)


@app.callback()
def _group() -> None:
    """Debug reward functions."""


def _parse_settings(name: str, items: list[str]) -> dict:
    from posttrain.core.config_source import split_setting

    out, errors = {}, []
    for item in items:
        setting = split_setting(item)
        if setting is None:
            errors.append(f"{item}: a reward setting must look like key=value")
            continue
        out[setting[0]] = setting[1]
    if errors:
        raise ConfigError(errors, f"rl-cli rewards try {name}")
    return out


@app.command("try")
def try_(name: str = typer.Argument(..., help="reward name (see `rl-cli plugins list --kind reward`)",
                                    show_default=False),
         settings: list[str] = typer.Argument(None, help="reward config as key=value (e.g. think_end=null)",
                                              show_default=False),
         response: str = typer.Option(..., "--response", "-r", help="the model's response text", show_default=False),
         label: str = typer.Option(None, "--label", "-l", help="the reference answer (JSON text for structured labels)"),
         prompt: str = typer.Option("", "--prompt", help="the prompt text"),
         metadata: str = typer.Option("{}", "--metadata", help="sample metadata as a JSON object"),
         response_length: int = typer.Option(None, "--response-length",
                                             help="response length in tokens (default: its length in characters)"),
         plugin: list[str] = PluginFiles, disable: list[str] = Disabled) -> None:
    """Score one response with reward NAME and print the score dict (JSON)."""
    import asyncio
    import inspect

    from posttrain.core.rewards import normalize_result
    from posttrain.core.schema import build
    from posttrain.core.types import Sample

    plugins = load(plugin, disable)
    cls = plugins.rewards.get_or_raise(name)
    config, errors = build(getattr(cls, "Config"), _parse_settings(name, settings or []), name)
    if errors:
        raise ConfigError(errors, f"rl-cli rewards try {name}")
    try:
        meta = json.loads(metadata)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--metadata: not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(meta, dict):
        raise UsageError("--metadata: expected a JSON object")
    sample = Sample(prompt=prompt, response=response, label=label, metadata=meta,
                    response_length=len(response) if response_length is None else response_length)
    reward = cls(config)
    scope = getattr(reward, "scope", "sample")
    try:
        out = reward([sample] if scope == "group" else sample)
        if inspect.isawaitable(out):
            out = asyncio.run(_finish(reward, out))
        if scope == "group":
            out = out[0]
        result = normalize_result(out, name)
    except Exception as exc:
        raise UsageError(f"reward {name} failed on this sample: {type(exc).__name__}: {exc}") from None
    console.print_json(json.dumps(result))


async def _finish(reward, awaitable):
    try:
        return await awaitable
    finally:
        closer = getattr(reward, "aclose", None)
        if closer is not None:
            await closer()
