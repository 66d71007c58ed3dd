"""The ``openai_agent`` generator: the user's agent, written against an OpenAI-compatible API, runs unchanged
during RL against an endpoint that records every token the engines sample.

``server``: the OpenAI-compatible HTTP endpoint; ``session``: one sample's conversation behind it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
from dataclasses import dataclass
from typing import Literal

from posttrain import hookimpl
from posttrain.api import Component
from posttrain.core.schema import option


class OpenAIAgent(Component):
    """Run an agent (``posttrain_register_agents``) per sample against a per-run OpenAI-compatible endpoint.

    The endpoint (127.0.0.1, a free port, the run's engine API key) gives each sample its own base URL
    ``http://127.0.0.1:PORT/s/<id>/v1`` with ``/chat/completions`` (``tools``, ``stop``, ``max_tokens``,
    ``stream``), ``/completions`` and ``/models``. It forwards token ids to the engines through the run's
    ``EngineClient`` and keeps each conversation's running token list
    (``posttrain.core.rollout.chat.Conversation``): a request appends only its new messages, rendered in
    context by the model's chat template; the engine's tokens are never re-tokenized. A turn's sampling
    comes from the run (``rollout.temperature``, its seed per sample and turn) so the trainer's log-probs
    match; the request's ``max_tokens`` and ``stop`` apply (its temperature/top_p too with
    ``request_sampling: true``). The response budget of a sample is ``rollout.max_new_tokens`` over all its turns.

    The conversation becomes one sample (``samples: conversation``; model tokens in the loss mask, system,
    user and tool tokens out, per-token log-probs from the engine) or one per model turn (``samples: turn``).
    A request whose history does not extend the conversation's starts a branch, which becomes its own sample
    (``keep_branches``) and is counted. The agent's return value: a string is the sample's ``response`` (the
    run's rewards score it); a float goes to ``metadata["agent_reward"]`` (the ``agent_reward`` reward).
    An agent that raises, runs past ``timeout_s`` or sends more than ``max_turns`` requests marks its sample
    ``failed`` (not trained on); the group and the step go on.

    Metrics: ``rollout/agent_failed``, ``rollout/retokenization_mismatch`` (model turns whose whole
    re-rendering tokenizes differently from what was sampled), ``rollout/agent_branches``,
    ``rollout/template_prefix_breaks`` (sums); ``rollout/turns_per_sample``, ``rollout/tool_calls_per_sample``,
    ``rollout/agent_seconds`` (means).
    """

    name = "openai_agent"

    @dataclass
    class Config:
        agent: str = option("chat", help="the agent to run (posttrain_register_agents; `rl-cli plugins list "
                                         "--kind agent`)")
        timeout_s: float = option(300.0, gt=0, help="seconds one sample's agent may run")
        call_timeout_s: float = option(120.0, gt=0, help="seconds one endpoint request may wait for the engine")
        max_turns: int = option(16, ge=1, help="requests one sample's agent may send")
        samples: Literal["conversation", "turn"] = option(
            "conversation", help="one training sample per conversation (branch), or one per model turn")
        keep_branches: bool = option(True, help="train on every branch of an edited history, not only the last")
        request_sampling: bool = option(False, help="honour the request's temperature/top_p/top_k/seed (the "
                                                    "trainer's log-probs assume the run's temperature)")
        eos_ends_turn: bool = option(False, help="also end a turn at the tokenizer's EOS, not only at the "
                                                 "template's end-of-turn token")
        tool_format: str = option("auto", help="tool-call format of the chat template: auto (detected from it), "
                                               "hermes (Qwen), llama_json, glm_xml, deepseek")
        model_name: str = option("policy", help="the model id the endpoint reports and accepts")

    def __init__(self, config=None, agent=None):
        super().__init__(config)
        self._agent = agent  # the callable; None until bind() takes it from the run's registry
        self._endpoint = None
        self._loop = None

    def check_config(self, run, plugins) -> list[str]:
        """Config errors: an agent the registry lacks, an unknown tool format."""
        errors = []
        if self.config.agent not in plugins.agents:
            errors.append(f"generator.agent: {plugins.agents.unknown_message(self.config.agent)}")
        from posttrain.core.rollout.chat import TOOL_FORMATS

        if self.config.tool_format not in ("auto", *TOOL_FORMATS):
            errors.append(f"generator.tool_format: unknown format {self.config.tool_format!r}. "
                          f"Valid: auto, {', '.join(TOOL_FORMATS)}")
        return errors

    def bind(self, plugins) -> None:
        """Take the agent from the run's plugin set (called by ``Selection.create``)."""
        if self._agent is None:
            from posttrain.plugins.generators.multi_turn import _tool_callable

            self._agent = _tool_callable(plugins.agents.get_or_raise(self.config.agent))

    async def endpoint(self, engine):
        """The endpoint of the running event loop (started on first use, with the engines' API key)."""
        import secrets

        from posttrain.plugins.generators.openai_agent.server import AgentEndpoint

        loop = asyncio.get_running_loop()
        if self._endpoint is None or self._loop is not loop:
            key = getattr(engine, "api_key", None) or secrets.token_urlsafe(16)
            self._endpoint, self._loop = await AgentEndpoint(key).start(), loop
        return self._endpoint

    async def __call__(self, group, engine, sampling):
        from posttrain.core.rollout.samples import engine_tokenizer

        if self._agent is None:
            raise RuntimeError("openai_agent: no agent bound; build it with Selection.create(plugins) or "
                               "OpenAIAgent(config, agent=fn)")
        tokenizer = await engine_tokenizer(engine)
        endpoint = await self.endpoint(engine)
        outs = await asyncio.gather(*[self.rollout(s, engine, sampling, tokenizer, endpoint) for s in group])
        return [s for out in outs for s in out]

    async def _run_agent(self, url: str, key: str, sample):
        if inspect.iscoroutinefunction(self._agent) or inspect.iscoroutinefunction(
                getattr(self._agent, "__call__", None)):
            return await self._agent(url, key, sample)
        return await asyncio.to_thread(self._agent, url, key, sample)  # a sync agent must not block the loop

    async def rollout(self, sample, engine, sampling, tokenizer, endpoint) -> list:
        """Run the agent on ``sample``; return its training samples (``[sample]`` marked failed if it failed)."""
        from posttrain.plugins.generators.openai_agent.session import Session

        fmt = None if self.config.tool_format == "auto" else self.config.tool_format
        session = Session(sample, engine, sampling, tokenizer, self.config, fmt)
        url = endpoint.open(session)
        t0 = time.monotonic()
        task = asyncio.ensure_future(self._run_agent(url, endpoint.api_key, sample))
        result, error = None, None
        try:
            done, _ = await asyncio.wait({task}, timeout=self.config.timeout_s)
            if not done:  # hung: cancelled, not awaited (an agent may swallow the cancellation)
                task.cancel()
                error = f"agent timed out after timeout_s={self.config.timeout_s:g}"
            elif task.exception() is not None:
                exc = task.exception()
                error = f"agent raised {type(exc).__name__}: {exc}"
            else:
                result = task.result()
        finally:
            endpoint.close(session)
        if error is None and session.over_budget:
            error = f"agent exceeded max_turns={self.config.max_turns}"
        return self.samples(sample, session, result, error, time.monotonic() - t0)

    def samples(self, sample, session, result, error, seconds: float) -> list:
        """The training samples of a finished conversation, the first carrying the conversation's metrics."""
        from posttrain.core.rollout.samples import fill
        from posttrain.core.types import SampleStatus

        conv = session.conv
        segments = [seg for seg in conv.segments if seg.turns]
        if not self.config.keep_branches:
            segments = segments[-1:]
        if error is None and not segments:
            error = "agent made no model call"
        metrics = ({"agent_failed": float(error is not None), "retokenization_mismatch": float(conv.mismatches),
                    "agent_branches": float(conv.branches), "template_prefix_breaks": float(conv.prefix_breaks)},
                   {"turns_per_sample": float(conv.turns), "tool_calls_per_sample": float(conv.tool_calls),
                    "agent_seconds": seconds})
        if error is not None:
            sample.status, sample.error, sample.response_length = SampleStatus.FAILED, error, 0
            sample.metadata["rollout_sums"], sample.metadata["rollout_means"] = metrics
            return [sample]
        text = result if isinstance(result, str) else session.last_content
        finish = "length" if session.truncated else "stop"
        out = []
        for seg in segments:
            spans = [(seg.prompt_length, seg.turns[-1][1])] if self.config.samples == "conversation" else seg.turns
            for start, end in spans:
                s = dataclasses.replace(sample, metadata=dict(sample.metadata), reward_parts={})
                if not isinstance(result, str) and result is not None:
                    s.metadata["agent_reward"] = float(result)
                fill(s, seg.tokens[:start], seg.tokens[start:end], seg.mask[start:end], seg.logprobs[start:end],
                     text, finish, session.version, weight_versions=seg.versions[start:end])
                out.append(s)
        out[0].metadata["rollout_sums"], out[0].metadata["rollout_means"] = metrics
        return out


@hookimpl
def posttrain_register_generators(registry):
    registry.add(OpenAIAgent)
