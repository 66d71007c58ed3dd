"""The ``single_turn`` generator: one ``/generate`` per sample."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from posttrain import hookimpl
from posttrain.api import Component
from posttrain.core.schema import option


class SingleTurn(Component):
    """One ``/generate`` call per sample (token in, token out).

    Fills ``tokens`` (prompt + response ids), ``response`` (the engine's text), ``rollout_log_probs``
    (``log_softmax(logits / T)`` of each sampled token, from ``meta_info.output_token_logprobs``),
    ``loss_mask`` (all ones: every response token is the model's), ``status`` (``truncated`` when
    ``max_new_tokens`` is hit, ``aborted`` when the engine aborted it) and ``weight_version``.
    Chat-message prompts go through the tokenizer's chat template. A sample with ``images`` has its image
    tokens expanded (:func:`~posttrain.core.rollout.samples.with_images`) and sends them as ``image_data``.
    """

    name = "single_turn"

    @dataclass
    class Config:
        batch_group: bool = option(True, help="send a group as one batched /generate (SGLang's list input) "
                                              "instead of one request per sample (seeded runs on SGLang "
                                              "engines send one per sample: each has its own seed)")

    async def __call__(self, group, engine, sampling):
        from posttrain.core.rollout.client import tokens_and_logprobs, weight_version_int
        from posttrain.core.rollout.samples import engine_tokenizer, fill, finish_type, prompt_ids, with_images

        tokenizer = await engine_tokenizer(engine)

        def store(sample, prompt, out):
            ids, lps = tokens_and_logprobs(out)
            return fill(sample, prompt, ids, [1] * len(ids), lps or [0.0] * len(ids), out.get("text", ""),
                        finish_type(out), weight_version_int(out), last_response=out)

        seen: dict[str, list[int]] = {}  # a group's samples share their prompt: tokenize it once

        def ids(sample):
            if sample.tokens or not isinstance(sample.prompt, str):
                return prompt_ids(sample, tokenizer)
            if sample.prompt not in seen:
                seen[sample.prompt] = prompt_ids(sample, tokenizer)
            return list(seen[sample.prompt])

        prompts, images = await with_images(group, [ids(s) for s in group], engine)
        params = sampling.for_group(group) if self.config.batch_group and len(group) > 1 else None
        if params is not None:  # None: seeded on engines that cannot seed a batch by row
            body = {"input_ids": prompts, "return_logprob": True, "sampling_params": params,
                    **sampling.request_fields(), **({"image_data": images} if images else {})}
            outs = await engine.request("POST", "/generate", body)
            return [store(s, p, o) for s, p, o in zip(group, prompts, outs)]

        async def one(sample, prompt):
            extra = {"image_data": sample.images} if sample.images else {}
            out = await engine.generate(input_ids=prompt, sampling_params=sampling.for_sample(sample),
                                        return_logprob=True, **sampling.request_fields(), **extra)
            return store(sample, prompt, out)

        return list(await asyncio.gather(*[one(s, p) for s, p in zip(group, prompts)]))


@hookimpl
def posttrain_register_generators(registry):
    registry.add(SingleTurn)
