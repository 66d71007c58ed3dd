"""The ``multi_turn`` generator: a tool-calling loop over the SGLang protocol."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from posttrain import hookimpl
from posttrain.api import Component
from posttrain.core.schema import option


class MultiTurn(Component):
    """Generate, run the tools the model calls, append their results, generate again (up to ``max_turns``).

    Each turn: ``/generate`` on ``prompt + response so far`` (stopping after ``</tool_call>``); tool calls
    are parsed from the turn's text (``parser``, default Qwen/Hermes ``<tool_call>{json}</tool_call>``);
    each tool runs with ``tool_timeout_s`` and a failure becomes error text for the model; the results,
    wrapped by ``tool_response_template``, are tokenized and appended with ``loss_mask`` 0 and log-prob 0.
    So ``loss_mask`` is 1 exactly on tokens the model generated. The total response is bounded by
    ``max_new_tokens``; hitting it marks the sample ``truncated``. A sample's prompt ``images`` go with every
    turn's ``/generate`` as ``image_data`` (its image tokens expanded once; tools add no images). Tools come from
    the run's ``tools``
    registry (``posttrain_register_tools``, handed over by :meth:`bind`, so ``--plugin`` files and ``-p``
    apply); ``tools: []`` offers every registered tool. Unknown tool or parser names are config errors
    (:meth:`check`), reported before anything starts.
    """

    name = "multi_turn"

    @dataclass
    class Config:
        max_turns: int = option(4, ge=1, help="model turns per sample")
        tool_timeout_s: float = option(10.0, gt=0, help="seconds each tool call may take")
        tools: list[str] = option(default_factory=list, help="tool names to offer; empty: all registered")
        parser: str = option("hermes", help="tool-call parser name (posttrain.core.rollout.tools.PARSERS)")
        tool_response_template: str = option(
            "<|im_end|>\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
            help="text appended after a turn with tool calls; {result} is the tools' answers joined by newlines")

    def __init__(self, config=None, tools=None):
        super().__init__(config)
        self._tools = tools  # name -> callable; None until bind() gives the run's registry

    def check_config(self, run, plugins) -> list[str]:
        """Config errors: tool names the run's registry lacks, an unknown parser."""
        from posttrain.core.rollout.tools import PARSERS

        errors = [f"generator.tools.{i}: {plugins.tools.unknown_message(n)}"
                  for i, n in enumerate(self.config.tools) if n not in plugins.tools]
        if self.config.parser not in PARSERS:
            errors.append(f"generator.parser: unknown parser {self.config.parser!r}. Valid: {', '.join(PARSERS)}")
        return errors

    def bind(self, plugins) -> None:
        """Take the tools from the run's plugin set (called by ``Selection.create``)."""
        if self._tools is None:
            names = self.config.tools or list(plugins.tools)
            self._tools = {n: _tool_callable(plugins.tools.get_or_raise(n)) for n in names}

    def tools(self) -> dict:
        if self._tools is None:
            raise RuntimeError("multi_turn: no tools bound; build it with Selection.create(plugins) or "
                               "MultiTurn(config, tools={...})")
        return self._tools

    async def __call__(self, group, engine, sampling):
        from posttrain.core.rollout.samples import engine_tokenizer

        tokenizer = await engine_tokenizer(engine)
        return list(await asyncio.gather(*[self.rollout(s, engine, sampling, tokenizer) for s in group]))

    async def rollout(self, sample, engine, sampling, tokenizer):
        from posttrain.core.rollout.client import tokens_and_logprobs, weight_version_int
        from posttrain.core.rollout.preempt import token_weight_versions
        from posttrain.core.rollout.samples import fill, finish_type, prompt_ids, with_images
        from posttrain.core.rollout.tools import PARSERS, run_tool

        parser = PARSERS[self.config.parser]
        tools = self.tools()
        prompt = (await with_images([sample], [prompt_ids(sample, tokenizer)], engine))[0][0]
        images = {"image_data": sample.images} if sample.images else {}
        ids: list[int] = []
        mask: list[int] = []
        lps: list[float] = []
        versions: list[int] = []  # each token's weight version (tool results: their turn's)
        text = ""
        finish, version, out = "stop", 0, None
        params = sampling.to_sglang()  # the seed, if any, is set per turn below
        stops = list(params.get("stop") or [])
        params["stop"] = stops + ["</tool_call>"] if "</tool_call>" not in stops else stops
        params["no_stop_trim"] = True  # keep the closing tag in the text the parser reads
        for turn in range(self.config.max_turns):
            budget = sampling.max_new_tokens - len(ids)
            if budget <= 0:
                finish = "length"
                break
            seed = sampling.sampling_seed(sample, turn)
            seeded = {} if seed is None else {"sampling_seed": seed}
            out = await engine.generate(input_ids=prompt + ids, **sampling.request_fields(), **images,
                                        sampling_params={**params, **seeded, "max_new_tokens": budget})
            new_ids, new_lps = tokens_and_logprobs(out)
            ids += new_ids
            mask += [1] * len(new_ids)
            lps += new_lps or [0.0] * len(new_ids)
            versions += token_weight_versions(out, len(new_ids))
            turn_text = out.get("text", "")
            text += turn_text
            finish, version = finish_type(out), weight_version_int(out)
            if finish != "stop":
                break
            calls = parser(turn_text)
            if not calls or turn == self.config.max_turns - 1:
                break
            results = await asyncio.gather(*[run_tool(c, tools, self.config.tool_timeout_s) for c in calls])
            env_text = self.config.tool_response_template.format(result="\n".join(results))
            env_ids = tokenizer.encode(env_text, add_special_tokens=False)
            env_ids = env_ids[: max(0, sampling.max_new_tokens - len(ids))]
            ids += env_ids
            mask += [0] * len(env_ids)
            lps += [0.0] * len(env_ids)
            versions += [weight_version_int(out)] * len(env_ids)
            text += tokenizer.decode(env_ids)
        sample.metadata.setdefault("turns", 0)
        sample.metadata["turns"] = turn + 1
        # the last turn read every earlier token: its routed experts (if asked) cover the whole sample
        return fill(sample, prompt, ids, mask, lps, text, finish, version, last_response=out, weight_versions=versions)


def _tool_callable(component):
    """The callable behind a registered tool: the registry wraps plain functions in a class (``.function``);
    a tool class is built from its ``Config`` and called."""
    if hasattr(component, "function"):
        return component.function
    if isinstance(component, type):
        config = getattr(component, "Config", None)
        return component(config() if config is not None else None)
    return component


@hookimpl
def posttrain_register_generators(registry):
    registry.add(MultiTurn)
