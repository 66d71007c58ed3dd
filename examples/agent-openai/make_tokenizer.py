"""Write the example's tokenizer: posttrain's character tokenizer (the tiny quickstart model's) with a compact
GLM-style chat template that offers tools, padded to the model's 128 rows, and check it with the
token-in-token-out conformance suite before saving.

    python examples/agent-openai/make_tokenizer.py     # -> examples/agent-openai/tokenizer/
"""

from __future__ import annotations

import sys
from pathlib import Path

NL = "{{ '\\n' }}"
# GLM-style: one special token per role and no end-of-turn token (a turn ends where the model writes the next
# role's token), so the question sits a few tokens before the answer: a random two-layer model finds it sooner.
# Tools as one line of signatures (a character model pays a token per character of its prompt); calls as
# GLM-4.5 writes them: <tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>
TEMPLATE = (
    "{% if tools %}<|system|>" + NL + "{% for t in tools %}{{ t.function.name }}("
    "{{ t.function.parameters.properties.keys() | join(', ') }}){% endfor %}{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}<|assistant|>" + NL + "{{ m.content }}"
    "{% for tc in m.tool_calls or [] %}{% if m.content or not loop.first %}" + NL + "{% endif %}"
    "<tool_call>{{ tc.function.name }}{% for k, v in tc.function.arguments.items() %}" + NL
    + "<arg_key>{{ k }}</arg_key>" + NL + "<arg_value>{{ v if v is string else v | tojson }}</arg_value>{% endfor %}"
    + NL + "</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}{% if messages[loop.index0 - 1].role != 'tool' %}<|observation|>{% endif %}" + NL
    + "<tool_response>" + NL + "{{ m.content }}" + NL + "</tool_response>"
    "{% else %}<|{{ m.role }}|>" + NL + "{{ m.content }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>" + NL + "{% endif %}"
)


def main(out: Path) -> None:
    from posttrain.testing.chat_conformance import check_template
    from posttrain.testing.chat_templates import chat_tokenizer

    tok = chat_tokenizer("glm4", TEMPLATE, vocab_size=128)
    problems = check_template(tok, conversations=20)
    if problems:
        sys.exit("the template is not token-in-token-out:\n" + "\n".join(problems[:10]))
    tok.save_pretrained(str(out))
    print(f"{out}: {len(tok)} tokens, chat template conformant over 20 random tool conversations")


if __name__ == "__main__":
    main(Path(__file__).with_name("tokenizer"))
