"""Run under ``torchrun --nproc_per_node 2``: the trainer with TP=2 on gloo; rank 0 saves the results.

usage: tp_worker.py HF_DIR OUT_FILE CKPT_DIR [dp|pp|kept]
       tp_worker.py - OUT_FILE - init-tp|init-pp|init-pp-tied

With ``pp``: TP=1, PP=2 (one layer per stage) instead of TP=2. With ``kept``: TP=2 with ``log_probs_recompute=False``. With ``dp``: TP=1 and data parallelism over the two processes instead, each rank given the whole batch
and taking its share (balanced by tokens).
With ``init-*``: no checkpoint; the weights seeded initialization draws (seed 3) at TP=2 or PP=2 (tied
embeddings with ``-tied``), exported as HF tensors (``last_stage_output`` is the last stage's tied copy).
"""

from __future__ import annotations

import sys


def main() -> None:
    import torch
    import torch.distributed as dist

    from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer
    from train_helpers import local_loss, spec_for, tp_batch, trainer_configs

    hf_dir, out_file, ckpt = sys.argv[1:4]
    torch.set_num_threads(1)
    if sys.argv[4:] == ["dp"]:
        return data_parallel(hf_dir, out_file)
    if sys.argv[4:] and sys.argv[4].startswith("init-"):
        return seeded(out_file, sys.argv[4])
    parallel = {"tp": 1, "pp": 2} if sys.argv[4:] == ["pp"] else {"tp": 2}
    if sys.argv[4:] == ["kept"]:
        parallel["log_probs_recompute"] = False
    configs = trainer_configs(lr=1e-3, micro_batch_size=2, global_batch_size=4, **parallel)
    trainer = MegatronTrainer(spec_for("qwen3", hf_dir), **configs)
    batch = tp_batch()
    lp, ent = trainer.log_probs(batch, with_entropy=True)
    batch.old_log_probs = lp
    metrics = trainer.train_step(batch, local_loss)
    trainer.save(ckpt)
    exported = {k: v.clone() for bucket in trainer.export_hf(1 << 20) for k, v in bucket}
    trainer.train_step(batch, local_loss)
    after_two = {k: v.clone() for bucket in trainer.export_hf(1 << 20) for k, v in bucket}
    fresh = MegatronTrainer(spec_for("qwen3", hf_dir), **configs)
    fresh.load(ckpt)
    fresh.train_step(batch, local_loss)
    reloaded = {k: v.clone() for bucket in fresh.export_hf(1 << 20) for k, v in bucket}
    same = all(torch.equal(reloaded[k], after_two[k]) for k in after_two)
    if dist.get_rank() == 0:
        torch.save({"lp": lp, "ent": ent, "metrics": metrics, "params": exported, "reload_same": same}, out_file)
    dist.barrier()
    dist.destroy_process_group()


def data_parallel(hf_dir: str, out_file: str) -> None:
    import torch
    import torch.distributed as dist

    from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer
    from train_helpers import local_loss, spec_for, tp_batch, trainer_configs

    trainer = MegatronTrainer(spec_for("qwen3", hf_dir), **trainer_configs(lr=1e-3, micro_batch_size=1,
                                                                           global_batch_size=4))
    batch = tp_batch()  # every rank gets the whole batch and takes its replica's share
    batch.old_log_probs = trainer_lp = trainer.log_probs(batch)[0]  # gathered back: [4, T] on every rank
    metrics = trainer.train_step(batch, local_loss)  # reduced over DP: the whole step's
    exported = {k: v.clone() for bucket in trainer.export_hf(1 << 20) for k, v in bucket}
    # the old log-probs from the train step itself (issue 17): gathered over DP like log_probs'
    fused = MegatronTrainer(spec_for("qwen3", hf_dir), **trainer_configs(lr=1e-3, micro_batch_size=1,
                                                                         global_batch_size=4))
    batch.old_log_probs = None
    fused_metrics, fused_lp, _ = fused.train_step(batch, local_loss, keep_log_probs=True)
    if dist.get_rank() == 0:
        torch.save({"params": exported, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                    "lp": trainer_lp, "fused_lp": fused_lp, "fused_loss": fused_metrics["loss"],
                    "fused_grad_norm": fused_metrics["grad_norm"]}, out_file)
    dist.barrier()
    dist.destroy_process_group()


def seeded(out_file: str, mode: str) -> None:
    import torch
    import torch.distributed as dist

    from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer
    from train_helpers import seeded_spec, trainer_configs

    spec = seeded_spec(tied=mode.endswith("-tied"))
    trainer = MegatronTrainer(spec, **trainer_configs(**({"tp": 2} if mode == "init-tp" else {"pp": 2})), seed=3)
    exported = {k: v.clone() for bucket in trainer.export_hf(1 << 20) for k, v in bucket}
    output = getattr(trainer.gpt, "output_layer", None)
    tied_copy = output.weight.detach().clone() if mode.endswith("-tied") and output is not None else None
    copies = [None, None]
    dist.all_gather_object(copies, tied_copy)
    if dist.get_rank() == 0:
        torch.save({"params": exported, "last_stage_output": copies[1]}, out_file)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # dist-checkpointing starts worker processes: the guard is required
    main()
