"""A teacher's log-probs of the student's samples, for on-policy distillation (estimators with
``needs = EstimatorNeeds(teacher=True)``, such as ``opd``).

The teacher is a second engine fleet (``teacher:`` in the run config, :class:`~posttrain.core.actors.
teacher.TeacherRole`) queried through SGLang's protocol: one ``/generate`` per sample with the sample's
``input_ids`` (prompt + response), ``max_new_tokens: 0``, ``return_logprob`` and ``logprob_start_len =
prompt_length - 1``. SGLang answers ``meta_info.input_token_logprobs``: ``[logprob, token_id, None]``
per token from that position on, the first without a value; the rest are ``log p_teacher`` of the
response tokens, in order, stored per sample as ``metadata["teacher_log_probs"]`` (``response_length``
floats) and handed to the estimator as ``AdvantageBatch.metadata["teacher_log_probs"]`` ``[B, T]``.

Teacher and student must share a tokenizer (the teacher scores the student's token ids): checked when
the run starts, before the teacher's engines do.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

from posttrain.core.errors import UsageError

TEACHER_KEY = "teacher_log_probs"


class Teacher:
    """The teacher's client: :meth:`score` fills a sample's ``metadata["teacher_log_probs"]``."""

    def __init__(self, client: Any):
        self.client = client

    async def score(self, sample: Any) -> None:
        start = sample.prompt_length - 1  # SGLang gives the first scored token no value: start one early
        out = await self.client.generate(input_ids=list(sample.tokens), sampling_params={"max_new_tokens": 0},
                                         return_logprob=True, logprob_start_len=start)
        finish = out["meta_info"].get("finish_reason") or {}
        if finish.get("type") == "abort":
            raise RuntimeError(f"teacher: the request was aborted: {finish.get('message', '')}")
        entries = out["meta_info"].get("input_token_logprobs") or []
        response = sample.tokens[sample.prompt_length:]
        if [int(e[1]) for e in entries[1:]] != response:
            raise RuntimeError(f"teacher: input_token_logprobs cover {len(entries) - 1} tokens, not the "
                               f"{len(response)} response tokens asked for (logprob_start_len {start})")
        sample.metadata[TEACHER_KEY] = [float(e[0]) for e in entries[1:]]


async def add_teacher_log_probs(group: list[Any], teacher: Teacher | None) -> None:
    """Score every sample of ``group`` that has a response with ``teacher`` (nothing without one)."""
    if teacher is None:
        return
    import asyncio

    await asyncio.gather(*[teacher.score(s) for s in group if s.response_length > 0])


def check_same_tokenizer(student: str, teacher: str) -> None:
    """Raise a one-line :class:`UsageError` unless the tokenizers at ``student`` and ``teacher`` map the
    same strings to the same ids (and agree on EOS)."""
    from transformers import AutoTokenizer

    a, b = AutoTokenizer.from_pretrained(student), AutoTokenizer.from_pretrained(teacher)
    va, vb = a.get_vocab(), b.get_vocab()
    differ = sum(va.get(tok) != vb.get(tok) for tok in set(va) | set(vb))
    if differ or a.eos_token_id != b.eos_token_id:
        raise UsageError(f"teacher: its tokenizer ({teacher}) is not the student's ({student}): {differ} of "
                         f"{max(len(va), len(vb))} tokens map to other ids, EOS {b.eos_token_id} vs "
                         f"{a.eos_token_id}; the teacher scores the student's token ids, so they must share one")


def teacher_resources(cfg: Any) -> Any:
    """The run's ``resources`` as the teacher's fleet sees them: its own engine count, never colocated with the
    trainer (the teacher keeps its weights; GPU engines name their device or go after the trainer's GPUs)."""
    import dataclasses

    return dataclasses.replace(cfg.resources, num_engines=cfg.teacher.num_engines, colocate=False)


def launch_teacher(cfg: Any, plugins: Any, executor: Any, log_dir: Any) -> Any:
    """The teacher role with its engines launched, when the config has a ``teacher:`` whose engines take none of
    the trainer's GPUs: they load ``teacher.path`` while the run builds its trainer. Else None (then
    :func:`open_teacher` starts it, after the trainer, in the memory the trainer leaves). The caller closes it."""
    t = cfg.teacher
    if t is None:
        return None
    gpus = set(t.engine.create(plugins).engine_gpus(teacher_resources(cfg)))
    if gpus & set(range(cfg.resources.trainer_gpus_per_node)):
        return None
    return executor.teacher(log_dir)


@asynccontextmanager
async def open_teacher(cfg: Any, role: Any, executor: Any, student_dir: str, log_dir: Any):
    """The run's :class:`Teacher` while the block runs (None when the config has no ``teacher:``): checks the
    tokenizers, then waits for the teacher's engines (``role``, from :func:`launch_teacher`), or starts them through
    ``executor`` when that gave none and stops them afterwards."""
    t = cfg.teacher
    if t is None:
        yield None
        return
    if t.tokenizer or t.path:
        check_same_tokenizer(student_dir, t.tokenizer or t.path)
    own = role is None
    role = executor.teacher(log_dir) if own else role
    try:
        role.wait_ready()
        from posttrain.core.rollout.client import EngineClient

        async with EngineClient(role.url(), max_concurrency=t.server_concurrency, api_key=role.api_key()) as client:
            if not (t.tokenizer or t.path):  # running servers: the tokenizer they report
                check_same_tokenizer(student_dir, (await client.get_model_info())["tokenizer_path"])
            yield Teacher(client)
    finally:
        if own:
            role.close()
