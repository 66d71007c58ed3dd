"""A user's own generator: multi-turn search over a local corpus, as one async function in a plugin file.

The model may write ``<search>query</search>``; the generator looks the query up in ``corpus.jsonl``
(next to this file, or ``$SEARCH_AGENT_CORPUS``) and appends ``<information>...</information>`` with
loss mask 0, then lets the model continue, up to ``MAX_TURNS`` turns, until it writes
``<answer>...</answer>``. The reward ``search_answer`` is 1.0 when the answer contains the label.

Use it with ``rl-cli run config.yaml --plugin search_agent.py`` or try it with ``python smoke.py --smoke``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from posttrain import hookimpl

MAX_TURNS = 3
CORPUS = os.environ.get("SEARCH_AGENT_CORPUS", str(Path(__file__).with_name("corpus.jsonl")))
SEARCH = re.compile(r"<search>(.*?)</search>", re.S)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


async def search_agent(group, engine, sampling):
    """Multi-turn search agent: ``<search>q</search>`` -> ``<information>`` (mask 0), until ``<answer>``."""
    from posttrain.core.rollout.client import tokens_and_logprobs, weight_version_int
    from posttrain.core.rollout.samples import engine_tokenizer, fill, finish_type, prompt_ids
    from posttrain.plugins.tools.local_search import load_corpus, search_corpus

    tokenizer = await engine_tokenizer(engine)
    corpus = load_corpus(CORPUS)
    for sample in group:
        prompt = prompt_ids(sample, tokenizer)
        ids, mask, lps, text, finish, version = [], [], [], "", "stop", 0
        for turn in range(MAX_TURNS):  # for_sample: the run's sampling seed, if any, per sample and turn
            params = {**sampling.for_sample(sample, turn), "stop": ["</search>", "</answer>"], "no_stop_trim": True}
            budget = sampling.max_new_tokens - len(ids)
            if budget <= 0:
                finish = "length"
                break
            out = await engine.generate(input_ids=prompt + ids, sampling_params={**params, "max_new_tokens": budget})
            new_ids, new_lps = tokens_and_logprobs(out)
            ids, mask, lps = ids + new_ids, mask + [1] * len(new_ids), lps + (new_lps or [0.0] * len(new_ids))
            text += out["text"]
            finish, version = finish_type(out), weight_version_int(out)
            query = SEARCH.search(out["text"])
            if finish != "stop" or query is None or ANSWER.search(out["text"]):
                break
            info = f"\n<information>{search_corpus(query.group(1), corpus, k=2)}</information>\n"
            info_ids = tokenizer.encode(info, add_special_tokens=False)[: max(0, sampling.max_new_tokens - len(ids))]
            ids, mask, lps = ids + info_ids, mask + [0] * len(info_ids), lps + [0.0] * len(info_ids)
            text += tokenizer.decode(info_ids)
        fill(sample, prompt, ids, mask, lps, text, finish, version)
    return group


class SearchAnswer:
    """1.0 when the text inside the last ``<answer>...</answer>`` contains the label (case-insensitive)."""

    name = "search_answer"

    def __init__(self, config=None):
        from dataclasses import dataclass

        @dataclass
        class _Config:
            pass

        self.config = config or _Config()

    def __call__(self, sample):
        answers = ANSWER.findall(sample.response)
        return {"score": float(bool(answers) and str(sample.label).lower() in answers[-1].lower())}


@hookimpl
def posttrain_register_generators(registry):
    registry.add(search_agent, name="search_agent")


@hookimpl
def posttrain_register_rewards(registry):
    registry.add(SearchAnswer)
