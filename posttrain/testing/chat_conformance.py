"""Token-in-token-out conformance of a chat template: random multi-turn conversations with tool calls, driven
through :class:`posttrain.core.rollout.chat.Conversation` as the ``openai_agent`` endpoint drives it, must give
the same model-turn tokens as the whole conversation rendered at once, with no branch, and every tool call must
parse back to what was rendered.

A "model" answers each assistant turn with exactly the template's rendering of that message, cut after its
end-of-turn token (or, for templates without one, followed by the token that opens the next message, as an
engine's stop token would be). :func:`check_template` returns one line per difference (empty: conformant)::

    from posttrain.testing.chat_conformance import check_template
    problems = check_template(tokenizer, conversations=20, seed=0)
"""

from __future__ import annotations

import random
from typing import Any

from posttrain.core.rollout.chat import TURN_ENDS, Conversation, template_message

TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool",
                                           "parameters": {"type": "object", "properties": {
                                               "x": {"type": "string"}, "n": {"type": "integer"}}}}}
         for name in ("calculator", "search")]
_WORDS = ["the", "sum", "is", "7", "let", "me", "check", "ok", "answer:", "42", "x+y", "(3*4)", "done", "a", "b"]


def _words(rng: random.Random, k: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(k)).replace(" 7 ", "\n7 ")


def random_conversation(rng: random.Random, max_calls: int, rounds: int = 3) -> list[dict[str, Any]]:
    """``system?, user, (assistant, tool results | user) x rounds, assistant``; assistant turns with 0 to
    ``max_calls`` tool calls (content with calls only where ``max_calls > 1``: one-call templates write none)."""
    msgs: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": _words(rng, 4)})
    msgs.append({"role": "user", "content": _words(rng, 5)})
    for r in range(rounds + 1):
        n = 0 if r == rounds else rng.randint(0, max_calls)
        content = "" if n and (max_calls == 1 or rng.random() < 0.5) else _words(rng, rng.randint(1, 6))
        calls = [{"id": f"call_{r}_{i}", "type": "function", "function": {
            "name": rng.choice(TOOLS)["function"]["name"],
            "arguments": {"x": _words(rng, 2), "n": rng.randint(0, 99)}}} for i in range(n)]
        msgs.append({"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})})
        if r < rounds:
            msgs += ([{"role": "tool", "tool_call_id": c["id"], "content": _words(rng, 3)} for c in calls] if calls
                     else [{"role": "user", "content": _words(rng, 4)}])
    return msgs


def _model_text(conv: Conversation, msgs: list[dict[str, Any]], i: int, tools: list | None) -> str:
    """What the simulated model writes for assistant message ``i``: the template's rendering of it, through its
    end-of-turn token, or followed by the token that opens the next message."""
    before = conv.render(msgs[:i], tools, gen=True)
    after = conv.render(msgs[:i + 1], tools, gen=False)
    turn = after[len(before):] if after.startswith(before) else after
    ends = [turn.rfind(e) + len(e) for e in TURN_ENDS if e in turn]
    if ends:
        return turn[:max(ends)]
    following = msgs[i + 1:i + 2] or [{"role": "user", "content": "x"}]  # the last turn: as if a user went on
    nxt = conv.render(msgs[:i + 1] + following, tools, gen=True)[len(after):]
    return turn + next((e for e in TURN_ENDS if nxt.startswith(e)), "")


def _first_diff(a: str, b: str) -> str:
    at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"char {at}: {a[max(0, at - 20):at + 30]!r} vs {b[max(0, at - 20):at + 30]!r}"


def check_conversation(tokenizer: Any, msgs: list[dict[str, Any]], tools: list | None,
                       convention: str | None = None) -> list[str]:
    """Differences between driving ``msgs`` incrementally and rendering them whole (empty: none)."""
    conv = Conversation(tokenizer, convention)
    problems, turns = [], []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt_before = conv.render(msgs[:i], tools, gen=True)
        if turns and not prompt_before.startswith(conv._rendered):
            problems.append(f"turn {len(turns)}: the render of the first {i} messages does not extend the render "
                            f"after the previous turn ({_first_diff(conv._rendered, prompt_before)})")
        conv.prepare(msgs[:i], tools)
        ids = conv.encode(_model_text(conv, msgs, i, tools))
        content, calls = conv.record(ids, [0.0] * len(ids))
        want = template_message(m)
        got = template_message({"role": "assistant", "content": content, "tool_calls": [{"function": c} for c in calls]})
        if (got["content"], got.get("tool_calls")) != (want["content"], want.get("tool_calls")):
            problems.append(f"turn {len(turns)}: parsed back as {got} instead of {want}")
        turns.append(ids)
    whole = conv.encode(conv.render(msgs, tools, gen=False))
    seg = conv.segment
    for k, (start, end) in enumerate(seg.turns if conv.branches == 0 else []):
        end = min(end, len(whole))  # a last turn's stop token that opens the next message is past the render
        if whole[start:end] != seg.tokens[start:end]:
            problems.append(f"turn {k}: tokens {start}..{end} are {seg.tokens[start:end][:12]}... incrementally, "
                            f"{whole[start:end][:12]}... rendered whole "
                            f"({_first_diff(tokenizer.decode(seg.tokens[start:end]), tokenizer.decode(whole[start:end]))})")
    for name in ("branches", "prefix_breaks", "mismatches"):
        if getattr(conv, name):
            problems.append(f"{name}: {getattr(conv, name)} (0 expected)")
    return problems


def check_template(tokenizer: Any, conversations: int = 20, seed: int = 0, max_calls: int = 2,
                   convention: str | None = None) -> list[str]:
    """:func:`check_conversation` over ``conversations`` random ones (with and without ``tools``); each
    problem line names its conversation."""
    rng = random.Random(seed)
    problems = []
    for c in range(conversations):
        msgs = random_conversation(rng, max_calls)
        tools = TOOLS if c % 4 else None
        problems += [f"conversation {c}: {p}" for p in check_conversation(tokenizer, msgs, tools, convention)]
    return problems
