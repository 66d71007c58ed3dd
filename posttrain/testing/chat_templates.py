"""Tiny chat templates in the formats of the model families posttrain ships specs for, written here (nothing is
downloaded): each renders system, user, assistant (content and ``tool_calls``) and tool messages, offers
``tools`` in its system prompt, and writes tool calls in its family's convention
(``posttrain.core.rollout.chat.parse_tool_calls`` reads them back):

- ``qwen3`` / ``qwen2.5``: ``<|im_start|>role\\n...<|im_end|>\\n``; calls ``<tool_call>\\n{"name", "arguments"}\\n</tool_call>``;
  tool results ``<tool_response>`` blocks in one user turn (qwen2.5 adds its default system prompt);
- ``llama3``: ``<|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>``; one call per turn as
  ``{"name", "parameters"}``; results in ``ipython`` turns;
- ``glm4``: ``[gMASK]<sop><|role|>\\n...`` with no end-of-turn token (the model stops on ``<|user|>`` or
  ``<|observation|>``, which open the next message); calls ``<tool_call>name`` + ``<arg_key>/<arg_value>`` pairs;
- ``deepseek_v3``: ``<｜User｜>`` / ``<｜Assistant｜>`` ... ``<｜end▁of▁sentence｜>``; calls in
  ``<｜tool▁calls▁begin｜>`` blocks with a JSON code fence; results in ``<｜tool▁output▁begin｜>`` blocks.

:data:`PLANTED` is a Qwen-style template that drops an empty ``<think></think>`` block from assistant turns
once a later user message follows (as Qwen3's drops earlier reasoning): an incremental render of it differs from
the whole render, which the conformance suite (``posttrain.testing.chat_conformance``) must report.
"""

from __future__ import annotations

NL = "{{ '\\n' }}"  # newlines as expressions: HF renders with trim_blocks, which eats a newline after a tag

_QWEN_TOOLS = (
    "{% if tools %}<|im_start|>system" + NL + "{% if messages[0].role == 'system' %}{{ messages[0].content }}"
    + NL + NL + "{% elif default_system %}{{ default_system }}" + NL + NL + "{% endif %}# Tools" + NL + NL
    + "You may call one or more functions. Function signatures are within <tools></tools>:" + NL + "<tools>"
    "{% for t in tools %}" + NL + "{{ t | tojson }}{% endfor %}" + NL + "</tools>" + NL + NL
    + "Return each call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>" + NL
    + "{% elif messages[0].role == 'system' %}<|im_start|>system" + NL + "{{ messages[0].content }}<|im_end|>" + NL
    + "{% elif default_system %}<|im_start|>system" + NL + "{{ default_system }}<|im_end|>" + NL + "{% endif %}"
)
_QWEN_CALLS = (
    "{% for tc in m.tool_calls or [] %}{% if m.content or not loop.first %}" + NL + "{% endif %}<tool_call>" + NL
    + "{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}" + NL
    + "</tool_call>{% endfor %}"
)


def _qwen(default_system: str = "", think: bool = False) -> str:
    setup = "{% set default_system = " + repr(default_system) + " %}"
    last_user = ("{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
                 "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}")
    body = "{{ m.content }}"
    if think:  # the planted flaw: the think block only on turns after the last user message
        body = "{% if loop.index0 > ns.last_user %}<think>" + NL + NL + "</think>" + NL + NL + "{% endif %}" + body
    gen_think = ("<think>" + NL + NL + "</think>" + NL + NL) if think else ""
    return (
        setup + last_user + _QWEN_TOOLS + "{% for m in messages %}"
        "{% if m.role == 'system' and loop.first %}"
        "{% elif m.role in ('user', 'system') %}<|im_start|>{{ m.role }}" + NL + "{{ m.content }}<|im_end|>" + NL
        + "{% elif m.role == 'assistant' %}<|im_start|>assistant" + NL + body + _QWEN_CALLS + "<|im_end|>" + NL
        + "{% elif m.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user"
        "{% endif %}" + NL + "<tool_response>" + NL + "{{ m.content }}" + NL + "</tool_response>"
        "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>" + NL + "{% endif %}"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant" + NL + gen_think + "{% endif %}"
    )


LLAMA3 = (
    "<|begin_of_text|>{% set first = 0 %}{% if messages[0].role == 'system' or tools %}"
    "<|start_header_id|>system<|end_header_id|>" + NL + NL + "{% if tools %}Environment: ipython" + NL
    + "Respond with a function call as {\"name\": function name, \"parameters\": arguments}." + NL
    + "{% for t in tools %}{{ t | tojson }}" + NL + "{% endfor %}{% endif %}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}<|eot_id|>{% endif %}"
    "{% for m in messages %}{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>" + NL + NL
    + "{% set tc = m.tool_calls[0].function %}{\"name\": \"{{ tc.name }}\", \"parameters\": {{ tc.arguments | tojson }}}"
    "<|eot_id|>"
    "{% else %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>" + NL + NL
    + "{{ m.content }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>" + NL + NL + "{% endif %}"
)

GLM4 = (
    "[gMASK]<sop>{% if tools %}<|system|>" + NL + "# Tools" + NL + "{% for t in tools %}{{ t | tojson }}" + NL
    + "{% endfor %}Call a tool as <tool_call>name<arg_key>key</arg_key><arg_value>value</arg_value></tool_call>"
    "{% endif %}{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|assistant|>" + NL + "{{ m.content }}{% for tc in m.tool_calls or [] %}"
    "{% if m.content or not loop.first %}" + NL + "{% endif %}<tool_call>{{ tc.function.name }}"
    "{% for k, v in tc.function.arguments.items() %}" + NL + "<arg_key>{{ k }}</arg_key>" + NL
    + "<arg_value>{{ v if v is string else v | tojson }}</arg_value>{% endfor %}" + NL + "</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|observation|>"
    "{% endif %}" + NL + "<tool_response>" + NL + "{{ m.content }}" + NL + "</tool_response>"
    "{% else %}<|{{ m.role }}|>" + NL + "{{ m.content }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>" + NL + "{% endif %}"
)

DEEPSEEK_V3 = (
    "<｜begin▁of▁sentence｜>{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}"
    "{% if tools %}" + NL + NL + "## Tools" + NL + "{% for t in tools %}{{ t | tojson }}" + NL + "{% endfor %}{% endif %}"
    "{% for m in messages %}{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<｜Assistant｜>{{ m.content }}{% if m.tool_calls %}<｜tool▁calls▁begin｜>"
    "{% for tc in m.tool_calls %}<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ tc.function.name }}" + NL + "```json"
    + NL + "{{ tc.function.arguments | tojson }}" + NL + "```<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜>"
    "{% endif %}<｜end▁of▁sentence｜>"
    "{% elif m.role == 'tool' %}{% if messages[loop.index0 - 1].role != 'tool' %}<｜tool▁outputs▁begin｜>{% endif %}"
    "<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<｜tool▁outputs▁end｜>{% endif %}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)

QWEN3 = _qwen()
QWEN25 = _qwen("You are Qwen, created by Alibaba Cloud. You are a helpful assistant.")
PLANTED = _qwen(think=True)

# family -> (template, special tokens its char tokenizer needs beyond posttrain's, at most tool calls per turn)
TEMPLATES: dict[str, tuple[str, tuple[str, ...], int]] = {
    "qwen3": (QWEN3, (), 2),
    "qwen2.5": (QWEN25, (), 2),
    "llama3": (LLAMA3, ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), 1),
    "glm4": (GLM4, ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"), 2),
    "deepseek_v3": (DEEPSEEK_V3, ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>",
                                  "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                                  "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
                                  "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"), 2),
}
# model spec / HF model_type -> template family
FAMILY_OF = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "qwen2": "qwen2.5", "llama": "llama3", "llama3": "llama3",
             "glm4": "glm4", "glm4_moe": "glm4", "deepseek_v3": "deepseek_v3"}


def chat_tokenizer(family: str, template: str | None = None, vocab_size: int | None = None):
    """posttrain's character tokenizer with ``family``'s special tokens and chat template (or ``template``).

    ``vocab_size``: pad the vocabulary with ``<|reserved_i|>`` special tokens up to the model's (the tiny models
    have 128 rows), as hub tokenizers name their padding rows, so that every id an engine can sample decodes to
    text that encodes back to it."""
    from posttrain.core.char_tokenizer import CHARS, SPECIAL_TOKENS, make_tokenizer

    chat, specials, _ = TEMPLATES[family]
    extra = [t for t in specials if t not in SPECIAL_TOKENS]
    reserved = [f"<|reserved_{i}|>" for i in range((vocab_size or 0) - len(SPECIAL_TOKENS) - len(CHARS) - len(extra))]
    return make_tokenizer(extra_special_tokens=extra + reserved, chat_template=template or chat)
