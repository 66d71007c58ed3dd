"""A calculator agent written with the official ``openai`` package, as it would run against any
OpenAI-compatible server; registered as a posttrain agent at the bottom.

    rl-cli run examples/agent-openai/config.yaml --plugin examples/agent-openai/calc_agent.py   # RL
    python examples/agent-openai/calc_agent.py --base-url http://localhost:8000/v1 --api-key KEY "3+4="

The agent offers a ``calculator`` tool, runs every call the model makes, sends the results back, and returns
the model's final answer; the run's ``exact_match`` reward scores it against the label.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import operator

from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from posttrain import hookimpl

MAX_STEPS = 4
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod}


def calculate(expression: str) -> str:
    """Integer arithmetic (+ - * // %) on literals; anything else is an error message for the model."""
    def ev(node):
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError("unsupported expression")
    try:
        return str(ev(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"


async def solve(client: AsyncOpenAI, question: str, model: str = "policy") -> str:
    """The tool loop: ask, run the calculator calls, ask again, until the model answers without a call."""
    messages = [{"role": "user", "content": question}]
    answer = ""
    for _ in range(MAX_STEPS):
        reply = await client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR],
                                                     max_tokens=64)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        answer = message.content or ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                result = calculate(json.loads(call.function.arguments).get("expression", ""))
            except (json.JSONDecodeError, AttributeError):
                result = "error: arguments must be a JSON object"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return answer


_HTTP: list = []  # one connection pool for every conversation (a client's own costs an SSL context: ~10 ms)


async def calculator_agent(base_url: str, api_key: str, sample) -> str:
    """posttrain's agent signature: a client for this sample's endpoint, the prompt as the question."""
    if not _HTTP:
        _HTTP.append(DefaultAsyncHttpxClient())
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=_HTTP[0])
    return await solve(client, sample.prompt)


@hookimpl
def posttrain_register_agents(registry):
    registry.add(calculator_agent, name="calculator_agent")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question")
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--model", default="policy")
    args = parser.parse_args()
    print(asyncio.run(solve(AsyncOpenAI(base_url=args.base_url, api_key=args.api_key), args.question, args.model)))
