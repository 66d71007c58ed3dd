"""Token in, token out for chat: a conversation's running token list, extended by the chat template one request
at a time, and the tool-call conventions of the chat templates posttrain knows.

An agent talks to a model in messages; the engine samples tokens. Rendering the whole conversation again at each
turn gives, in general, other tokens than the engine sampled (the template normalizes whitespace, drops reasoning
of earlier turns, or the tokenizer merges across a boundary), and a trainer that scores the re-rendered tokens
trains on tokens nobody sampled. :class:`Conversation` never re-renders what it has:

- the first request's messages are rendered whole, with the generation prompt (``P_0``), and tokenized;
- a model turn appends the engine's token ids ``g_k`` (loss mask 1, the engine's log-probs);
- the assistant message given back (content and ``tool_calls`` parsed from the turn, :func:`parse_tool_calls`)
  is rendered as the template would (``R_k = render(messages + [assistant])``); the template's text after the
  model's own output (``A_k = R_k[len(P_k):]`` minus the decoded turn: e.g. the ``\\n`` after ``<|im_end|>``,
  or a whole ``<|im_end|>\\n`` when the turn hit its token budget) is kept as a *tail*;
- the next request appends only ``tail + render(messages', gen)[len(R_k):]`` (loss mask 0): the new tool, user
  or system messages, rendered in context by the template, and the next generation prompt.

A request whose messages do not extend the conversation's (the agent edited history, changed its tools, or the
template does not render a conversation's prefix as a prefix) starts a new *segment* (a branch) from the whole
render; each segment is its own token list (its earlier model turns are then prompt, masked out).
``mismatches`` counts model turns whose tokens in a whole re-render (``tokenize(R_k)``) differ from the sampled
``g_k``: what a re-rendering trainer would have scored instead.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("posttrain.chat")

TOOL_FORMATS = ("hermes", "llama_json", "glm_xml", "deepseek")

# end-of-turn tokens of the known templates (the ones a tokenizer has are the engine's stop tokens)
TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<｜end▁of▁sentence｜>", "<|user|>", "<|observation|>")

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_GLM = re.compile(r"<tool_call>([^\n<]*)\n?(.*?)</tool_call>", re.S)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_DSV3 = re.compile(r"<｜tool▁call▁begin｜>(?:function)?<｜tool▁sep｜>([^\n]*)\n```(?:json)?\n(.*?)\n```<｜tool▁call▁end｜>",
                   re.S)


def detect_convention(template: str | None) -> str:
    """The tool-call convention of a chat template (one of :data:`TOOL_FORMATS`): ``deepseek`` (DeepSeek-V3's
    ``<｜tool▁call▁begin｜>`` blocks), ``glm_xml`` (GLM-4.5's ``<arg_key>/<arg_value>``), ``llama_json`` (Llama 3's
    ``{"name", "parameters"}`` turn) or ``hermes`` (Qwen's ``<tool_call>{json}</tool_call>``)."""
    t = template or ""
    if "tool▁call▁begin" in t:
        return "deepseek"
    if "<arg_key>" in t:
        return "glm_xml"
    if "<|start_header_id|>" in t:
        return "llama_json"
    return "hermes"


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _call(name: Any, args: Any) -> dict[str, Any] | None:
    args = _loads(args) if isinstance(args, str) else args
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return {"name": name.strip(), "arguments": args}


def parse_tool_calls(text: str, convention: str) -> tuple[str, list[dict[str, Any]]]:
    """``(content, calls)`` of a model turn's text (end-of-turn tokens removed): ``calls`` are
    ``{"name", "arguments": dict}`` in the template's format; malformed calls stay in ``content``."""
    for end in TURN_ENDS:
        text = text.removesuffix(end)
    calls: list[dict[str, Any]] = []
    if convention == "deepseek":
        head, sep, rest = text.partition("<｜tool▁calls▁begin｜>")
        calls = [c for c in (_call(n, a) for n, a in _DSV3.findall(rest)) if c] if sep else []
        return (head if calls else text), calls
    if convention == "llama_json":
        body = text.removeprefix("<|python_tag|>").strip()
        obj = _loads(body) if body.startswith("{") else None
        call = _call(obj.get("name"), obj.get("parameters", obj.get("arguments"))) if isinstance(obj, dict) else None
        return ("", [call]) if call else (text, [])
    pattern = _GLM if convention == "glm_xml" else _HERMES
    kept = []
    for match in pattern.finditer(text):
        if convention == "glm_xml":
            call = _call(match.group(1), {k.strip(): _loads(v) for k, v in _GLM_ARG.findall(match.group(2))})
        else:
            obj = _loads(match.group(1))
            call = _call(obj.get("name"), obj.get("arguments", {})) if isinstance(obj, dict) else None
        if call:
            calls.append(call)
            kept.append(match.span())
    for start, end in reversed(kept):
        text = text[:start] + text[end:]
    return (text.strip() if calls else text), calls


def openai_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Parsed calls as OpenAI ``tool_calls`` (``arguments`` a JSON string, a fresh ``id`` each)."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for c in calls]


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI content parts: the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI chat message as HF chat templates take it: string content, ``tool_calls`` with dict arguments."""
    out: dict[str, Any] = {"role": message.get("role"), "content": _text(message.get("content"))}
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = message[key]
    if message.get("tool_calls"):
        calls = []
        for c in message["tool_calls"]:
            fn = c.get("function", c)
            args = fn.get("arguments") or {}
            calls.append({"type": "function", "function": {"name": fn.get("name"),
                                                            "arguments": _loads(args) if isinstance(args, str) else args}})
        out["tool_calls"] = calls
    return out


def _key(message: dict[str, Any]) -> str:
    """What two messages must share to be the same turn (tool-call ids, which templates do not render, aside)."""
    return json.dumps(message, sort_keys=True, default=str)


@dataclass
class Segment:
    """One branch of a conversation: ``tokens`` (prompt and every turn), ``mask`` / ``logprobs`` / ``versions``
    per token (mask 1 and the engine's log-prob on model tokens; 0 on rendered ones), ``turns``: each model
    turn's ``(start, end)`` in ``tokens``."""

    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(default_factory=list)

    def add(self, ids: list[int], model: bool, logprobs: list[float] | None = None, version: int = 0) -> None:
        self.tokens += ids
        self.mask += [int(model)] * len(ids)
        self.logprobs += list(logprobs) if logprobs else [0.0] * len(ids)
        self.versions += [version] * len(ids)

    @property
    def prompt_length(self) -> int:
        return self.turns[0][0] if self.turns else len(self.tokens)


class Conversation:
    """One agent conversation's running token lists (see the module docstring).

    :param tokenizer: an HF tokenizer with a chat template.
    :param convention: the tool-call format (:func:`detect_convention` of the template when None).
    """

    def __init__(self, tokenizer: Any, convention: str | None = None):
        self.tokenizer = tokenizer
        self.convention = convention or detect_convention(getattr(tokenizer, "chat_template", None))
        self.segments: list[Segment] = []
        self.turns = self.tool_calls = self.mismatches = self.branches = self.prefix_breaks = 0
        self._messages: list[dict[str, Any]] = []  # template form of what the current segment holds
        self._tools: list[dict[str, Any]] | None = None
        self._rendered = ""  # the template's text of _messages (with the generation prompt after a request)
        self._tail = ""  # template text closing the last model turn, not yet in the tokens
        self._overhang = ""  # model text past the template's turn (a stop token that opens the next message)
        self._text: str | None = None  # completions mode: prompt + outputs so far, as text

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, gen: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=gen,
                                                  tokenize=False)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @property
    def segment(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    def _branch(self, text: str) -> list[int]:
        if self.segments:
            self.branches += 1
        self.segments.append(Segment())
        self.segment.add(self.encode(text), model=False)
        return list(self.segment.tokens)

    def prepare(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The token ids to generate from for a chat request (``messages`` as OpenAI sends them)."""
        msgs = [template_message(m) for m in messages]
        full = self.render(msgs, tools, gen=True)
        n = len(self._messages)
        extends = (self.segment is not None and self._text is None and tools == self._tools and len(msgs) > n
                   and [_key(m) for m in msgs[:n]] == [_key(m) for m in self._messages])
        delta = full[len(self._rendered):] if extends and full.startswith(self._rendered) else None
        if delta is not None and delta.startswith(self._overhang):
            self.segment.add(self.encode(self._tail + delta[len(self._overhang):]), model=False)
            ids = list(self.segment.tokens)
        else:
            # the history matched, but the template re-rendered it or the model's stop token opened another message
            self.prefix_breaks += int(extends)
            ids = self._branch(full)
        self._messages, self._tools, self._rendered, self._tail, self._overhang, self._text = (msgs, tools, full, "",
                                                                                               "", None)
        return ids

    def prepare_text(self, prompt: str) -> list[int]:
        """The token ids for a ``/completions`` prompt: the new text after the conversation's, else a branch."""
        if self.segment is not None and self._text is not None and prompt.startswith(self._text):
            self.segment.add(self.encode(prompt[len(self._text):]), model=False)
            ids = list(self.segment.tokens)
        else:
            ids = self._branch(prompt)
        self._text, self._messages = prompt, []
        return ids

    def record(self, ids: list[int], logprobs: list[float] | None, version: int = 0) -> tuple[str, list[dict]]:
        """Append a model turn (the engine's ``ids`` and log-probs); return its ``(content, tool calls)``."""
        seg = self.segment
        start = len(seg.tokens)
        seg.add(ids, model=True, logprobs=logprobs, version=version)
        seg.turns.append((start, len(seg.tokens)))
        self.turns += 1
        out = self.tokenizer.decode(ids, skip_special_tokens=False)
        if self._text is not None:  # completions: the text is the model's, nothing to parse
            self._text += out
            self.mismatches += int(self.encode(self._text)[start:start + len(ids)] != ids)
            return out, []
        content, calls = parse_tool_calls(out, self.convention)
        self.tool_calls += len(calls)
        message = template_message({"role": "assistant", "content": content,
                                    "tool_calls": [{"function": c} for c in calls]})
        msgs = self._messages + [message]
        whole = self.render(msgs, self._tools, gen=False)
        turn = whole[len(self._rendered):] if whole.startswith(self._rendered) else None
        again = self.encode(whole)[start:]
        self._tail = self._overhang = ""
        if turn is not None and out.startswith(turn) and len(out) > len(turn):
            # the turn's stop token opens the next message (GLM's <|observation|>): the next render's text
            self._overhang = out[len(turn):]
            self.mismatches += int(again != ids[:len(again)])
        else:
            self._tail = turn[len(out):] if turn is not None and turn.startswith(out) else ""
            self.mismatches += int(again[:len(ids)] != ids)
        if again[:len(ids)] != ids[:len(again)]:
            log.debug("model turn %d re-renders differently: sampled %r, template %r", self.turns, out, turn)
        self._messages, self._rendered = msgs, whole
        return content, calls
