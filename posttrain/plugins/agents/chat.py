"""The ``chat`` agent: the sample's prompt as one chat request, the model's answer as the result."""

from __future__ import annotations

from posttrain import hookimpl


async def chat(base_url: str, api_key: str, sample) -> str:
    """POST the prompt (a string becomes one user message; chat messages go as they are, with
    ``metadata["tools"]`` when the data has them) to ``{base_url}/chat/completions``; return the answer's
    content. The smallest agent: what ``single_turn`` does, through the OpenAI protocol."""
    import aiohttp

    messages = sample.prompt if isinstance(sample.prompt, list) else [{"role": "user", "content": sample.prompt}]
    body = {"model": "policy", "messages": messages}
    if sample.metadata.get("tools"):
        body["tools"] = sample.metadata["tools"]
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {api_key}"}) as http:
        async with http.post(f"{base_url}/chat/completions", json=body) as resp:
            answer = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {answer.get('error', {}).get('message', answer)}")
    return answer["choices"][0]["message"]["content"] or ""


@hookimpl
def posttrain_register_agents(registry):
    registry.add(chat, name="chat")
