"""One sample's conversation behind the agent endpoint: OpenAI requests in, engine ``/generate`` calls out, every
token recorded by a :class:`~posttrain.core.rollout.chat.Conversation`."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from posttrain.core.rollout.chat import Conversation, TURN_ENDS, openai_tool_calls


class RequestError(Exception):
    """A request the endpoint refuses: HTTP ``status`` and an OpenAI-style error message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def stop_token_ids(tokenizer: Any) -> list[int]:
    """The end-of-turn tokens of the known templates that ``tokenizer`` has (the engine's stop tokens)."""
    vocab = tokenizer.get_vocab()
    return sorted({vocab[t] for t in TURN_ENDS if t in vocab})


# OpenAI sampling fields -> SGLang sampling_params (honoured with ``request_sampling: true``)
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "seed": "sampling_seed"}


class Session:
    """The endpoint's state for one sample: its conversation, request count and the engine's last answer.

    ``config``: the ``openai_agent`` generator's Config (``max_turns``, ``call_timeout_s``, ``request_sampling``,
    ``eos_ends_turn``, ``model_name``)."""

    def __init__(self, sample: Any, engine: Any, sampling: Any, tokenizer: Any, config: Any,
                 convention: str | None = None):
        self.sample, self.engine, self.sampling, self.config = sample, engine, sampling, config
        self.conv = Conversation(tokenizer, convention)
        self.stops = stop_token_ids(tokenizer)
        self.sid = ""  # the endpoint's name for it
        self.requests = 0
        self.over_budget = False
        self.closed = False
        self.finish, self.version, self.truncated = "stop", 0, False
        self._sample_limited = False
        self.last_content = ""
        self.lock = asyncio.Lock()  # one request at a time: a conversation is a sequence

    def _params(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """``sampling_params`` for the next turn; None when the sample's response budget is spent."""
        seg = self.conv.segment
        used = len(seg.tokens) - seg.prompt_length if seg and seg.turns else 0
        remaining = self.sampling.max_new_tokens - used
        want = body.get("max_completion_tokens") or body.get("max_tokens")
        budget = min(remaining, int(want)) if want else remaining
        self._sample_limited = budget == remaining  # hitting it truncates the sample, not only the request
        if budget <= 0:
            return None
        params = self.sampling.for_sample(self.sample, self.conv.turns)
        params.update(max_new_tokens=budget, skip_special_tokens=False, no_stop_trim=True)
        if self.stops:
            params["stop_token_ids"] = sorted(set(params.get("stop_token_ids") or []) | set(self.stops))
            params["ignore_eos"] = not self.config.eos_ends_turn
        stop = body.get("stop")
        if stop:
            params["stop"] = list(params.get("stop") or []) + ([stop] if isinstance(stop, str) else list(stop))
        if self.config.request_sampling:
            params.update({ours: body[theirs] for theirs, ours in _SAMPLING.items() if body.get(theirs) is not None})
        return params

    def _admit(self, body: dict[str, Any]) -> None:
        if self.closed:
            raise RequestError(410, "this conversation is over (the agent's time ran out)")
        if int(body.get("n") or 1) != 1:
            raise RequestError(400, "n: only 1 choice per request (each sample is one conversation)")
        self.requests += 1
        if self.requests > self.config.max_turns:
            self.over_budget = True
            raise RequestError(400, f"turn budget exceeded: max_turns={self.config.max_turns} requests per sample")

    async def _generate(self, ids: list[int], params: dict[str, Any]) -> tuple[list[int], list[float] | None]:
        from posttrain.core.rollout.client import EngineRequestError, tokens_and_logprobs, weight_version_int
        from posttrain.core.rollout.samples import finish_type

        try:
            out = await asyncio.wait_for(self.engine.generate(input_ids=ids, sampling_params=params,
                                                              return_logprob=True, **self.sampling.request_fields()),
                                         self.config.call_timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(504, f"the engine did not answer in call_timeout_s={self.config.call_timeout_s:g}")
        except EngineRequestError as exc:
            raise RequestError(400, f"engine: {exc.message}") from None
        self.finish, self.version = finish_type(out), weight_version_int(out)
        self.truncated = self.finish == "length" and self._sample_limited
        return tokens_and_logprobs(out)

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """A ``/chat/completions`` request: the answer as an OpenAI ``chat.completion`` object."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "messages: a non-empty list of chat messages is required")
        self._admit(body)
        async with self.lock:
            ids = self.conv.prepare(messages, body.get("tools") or None)
            params = self._params(body)
            if params is None:
                self.truncated = True
                return _chat_response(self.config.model_name, "", [], "length", len(ids), 0)
            new, lps = await self._generate(ids, params)
            content, calls = self.conv.record(new, lps, self.version)
        self.last_content = content
        finish = "tool_calls" if calls else ("length" if self.finish == "length" else "stop")
        return _chat_response(self.config.model_name, content, openai_tool_calls(calls), finish, len(ids), len(new))

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """A ``/completions`` request (one string prompt): an OpenAI ``text_completion`` object."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise RequestError(400, "prompt: one string is required")
        self._admit(body)
        async with self.lock:
            ids = self.conv.prepare_text(prompt)
            params = self._params(body)
            text, new = "", []
            if params is not None:
                new, lps = await self._generate(ids, params)
                text, _ = self.conv.record(new, lps, self.version)
        self.last_content = text
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.config.model_name,
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": "length" if params is None or self.finish == "length" else "stop"}],
                "usage": _usage(len(ids), len(new))}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chat_response(model: str, content: str, tool_calls: list[dict], finish: str, prompt: int,
                   completion: int) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not tool_calls else None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": _usage(prompt, completion)}


def stream_chunks(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A ``chat.completion`` as the ``chat.completion.chunk`` objects of a stream: the whole message in one
    delta, then the finish reason."""
    choice = response["choices"][0]
    delta = {"role": "assistant", "content": choice["message"]["content"]}
    if choice["message"].get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(choice["message"]["tool_calls"])]
    head = {k: response[k] for k in ("id", "created", "model")}
    return [{**head, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
            {**head, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {},
                                                                     "finish_reason": choice["finish_reason"]}],
             "usage": response["usage"]}]
