"""Run under ``torchrun --nproc_per_node N``: the fsdp2 trainer on gloo at data-parallel size N; rank 0 saves.

usage: fsdp2_worker.py HF_DIR OUT_FILE CKPT_DIR [RESUME_DIR]

Builds the trainer on HF_DIR (float32, the contract's run config, micro-batches of 1), then: log-probs,
one step, a checkpoint to CKPT_DIR, the exported weights, a second step and its weights. With RESUME_DIR a
second model loads that checkpoint (written at another size) and takes the same second step.
"""

from __future__ import annotations

import sys


def exported(model) -> dict:
    return {k: v.clone() for bucket in model.export_hf(1 << 20) for k, v in bucket}


def main() -> None:
    import torch
    import torch.distributed as dist

    from posttrain.core.plugins import load_plugins
    from posttrain.testing.contracts.trainer import contract_batch, run_config

    hf_dir, out_file, ckpt = sys.argv[1:4]
    resume = sys.argv[4] if len(sys.argv) > 4 else None
    torch.set_num_threads(1)
    plugins = load_plugins(autoload=False)
    cls = plugins.registry("trainers")["fsdp2"]
    backend = cls(cls.Config())
    run = run_config(backend, micro_batch_size=1)
    run.model.config.path = hf_dir
    spec, loss = run.model.create(plugins), run.loss.create(plugins)

    def build():
        return backend.build(spec, run, seed=0)

    batch = contract_batch()
    model = build()
    lp, ent = model.log_probs(batch, with_entropy=True)
    batch.old_log_probs, batch.ref_log_probs = lp, lp - 0.01
    out = {"lp": lp, "ent": ent, "m1": model.train_step(batch, loss)}
    out["lp1"] = model.log_probs(batch)[0]
    model.save(ckpt)
    out["w1"] = exported(model)
    out["m2"] = model.train_step(batch, loss)
    out["w2"] = exported(model)
    if resume:
        fresh = build()
        fresh.load(resume)
        out["resumed_w1"] = exported(fresh)
        out["resumed_m2"] = fresh.train_step(batch, loss)
        out["resumed_w2"] = exported(fresh)
    if dist.get_rank() == 0:
        torch.save(out, out_file)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
