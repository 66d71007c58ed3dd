"""TRL's ``GRPOTrainer`` on the workload of ``examples/gpu/qwen3-1.7b-grpo.yaml``, on one GPU: the other side of
``python -m bench e2e`` on a GPU (our colocated step against TRL's, best measured on the same machine).

    python bench/trl_gpu.py [--steps 3] [--prompts 64] [--generations 8] [--new-tokens 512]

Workload, as our run's: the Qwen3-1.7B shape (28 layers, hidden 2048, GQA 16/8, MLP 6144, tied
embeddings) randomly initialized in bf16 (``posttrain``'s ``qwen3-1.7B`` preset, so the same config), the
character vocabulary, the quickstart prompts, 64 prompts x 8 completions of up to 512 new tokens (random
weights rarely stop early), temperature 1, reward 1 when a completion holds a digit, one optimizer step per
batch (``num_iterations`` 1, the whole batch generated at once, ``--micro-batch`` completions per forward and backward), beta 0 (no reference model), lr 1e-6, plain
``transformers.generate`` (no vLLM), gradient checkpointing off, SDPA attention. Seconds per optimizer step
(generation included) from a callback, plus TRL's own timing of generation where it logs one.

Prints one JSON line: ``step_s`` per step, ``step_s_median`` over the steps after the first, the
completion length, the GPU's peak memory.

Packages: the GPU image (torch 2.11, transformers, accelerate, pandas, pyarrow, xxhash, fsspec,
huggingface-hub, requests, pyyaml, jinja2, psutil) plus these wheels, carried in ``.whl/trl/`` and installed
with ``pip install --no-deps --target /tmp/trl`` (then ``PYTHONPATH=/tmp/trl``): ``trl-1.16.0``,
``datasets-5.2.0``, ``dill-0.4.1``, ``multiprocess-0.70.19`` (py3, Python 3.12, manylinux x86_64). Fetch them
here with::

    pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \\
        -d .whl/trl trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19

and posttrain itself (for the model preset and the tokenizer).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_checkpoint(out: Path, preset: str = "qwen3-1.7B") -> Path:
    """A random-init HF checkpoint of posttrain's Qwen3 ``preset`` with the character tokenizer, written to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from posttrain.core.plugins import load_plugins
    from posttrain.testing.tiny import make_tokenizer

    spec_cls = load_plugins(autoload=False).models["qwen3"]
    spec = spec_cls(spec_cls.Config(preset=preset, dtype="bfloat16"))
    hf = {k: v for k, v in spec.hf_config().items() if k not in ("architectures", "model_type", "torch_dtype", "dtype")}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**hf), dtype=torch.bfloat16, attn_implementation="sdpa")
    model.save_pretrained(out)
    make_tokenizer(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=64,
                        help="completions per forward/backward; the batch is still one optimizer step (gradient "
                             "accumulation over batch / micro-batch) generated at once (steps_per_generation)")
    parser.add_argument("--preset", default="qwen3-1.7B", help="posttrain's Qwen3 preset (tiny: a CPU smoke run)")
    args = parser.parse_args()
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_checkpoint(Path(tmp) / "model", args.preset)
        cuda = torch.cuda.is_available()
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        rows = [json.loads(line) for line in (ROOT / "examples" / "quickstart" / "prompts.jsonl").read_text().splitlines()]
        data = Dataset.from_list([{"prompt": r["prompt"]} for r in rows] * 100)
        tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
        model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16, attn_implementation="sdpa")
        lengths: list[float] = []

        def has_digit(completions, **_):
            lengths.append(statistics.mean(len(c) for c in completions))
            return [float(bool(re.search(r"[0-9]", c))) for c in completions]

        batch = args.prompts * args.generations
        micro = min(args.micro_batch, batch)
        if batch % micro:
            raise SystemExit(f"--micro-batch {micro} does not divide the batch of {batch} completions")
        # one generation of the whole batch, then batch / micro forward/backward passes, one optimizer step
        wanted = dict(output_dir=str(Path(tmp) / "out"), per_device_train_batch_size=micro,
                      gradient_accumulation_steps=batch // micro, steps_per_generation=batch // micro,
                      num_generations=args.generations,
                      num_iterations=1, max_completion_length=args.new_tokens, temperature=1.0, beta=0.0,
                      learning_rate=1e-6, lr_scheduler_type="constant", max_steps=args.steps, logging_steps=1,
                      report_to=[], save_strategy="no", bf16=cuda, use_cpu=not cuda, gradient_checkpointing=False, seed=0,
                      use_vllm=False, disable_tqdm=True)
        fields = set(GRPOConfig.__dataclass_fields__)
        config = GRPOConfig(**{k: v for k, v in wanted.items() if k in fields})
        times: list[float] = []
        logs: list[dict] = []

        class Clock(TrainerCallback):
            def on_step_begin(self, *a, **k):
                sync()
                self.t0 = time.perf_counter()

            def on_step_end(self, *a, **k):
                sync()
                times.append(time.perf_counter() - self.t0)

            def on_log(self, _args, _state, _control, logs_=None, **k):
                logs.append(dict(k.get("logs") or logs_ or {}))

        trainer = GRPOTrainer(model=model, reward_funcs=has_digit, args=config, train_dataset=data,
                              processing_class=tokenizer, callbacks=[Clock()])
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    later = times[1:] or times
    print(json.dumps({"bench": "trl_gpu", "trl": trl.__version__, "torch": torch.__version__,
                      "device": torch.cuda.get_device_name() if cuda else "cpu", "preset": args.preset, "prompts": args.prompts, "generations": args.generations, "micro_batch": micro,
                      "max_new_tokens": args.new_tokens, "steps": len(times), "step_s": [round(t, 2) for t in times],
                      "step_s_median": round(statistics.median(later), 2),
                      "completion_chars_mean": round(statistics.mean(lengths), 1) if lengths else None,
                      "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
                      "trl_logs": [{k: v for k, v in row.items() if "time" in k or "length" in k or k == "reward"}
                                   for row in logs][-args.steps:]}))


if __name__ == "__main__":
    main()
