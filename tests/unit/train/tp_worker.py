"""Run under ``torchrun --nproc_per_node 2``: the trainer with TP=2 on gloo; rank 0 saves the results.

usage: tp_worker.py HF_DIR OUT_FILE CKPT_DIR
"""

from __future__ import annotations

import sys


def main() -> None:
    import torch
    import torch.distributed as dist

    from posttrain.core.config import TrainerConfig
    from posttrain.core.train.trainer import MegatronTrainer
    from train_helpers import local_loss, spec_for, tp_batch

    hf_dir, out_file, ckpt = sys.argv[1:4]
    torch.set_num_threads(1)
    config = TrainerConfig(lr=1e-3, micro_batch_size=2, global_batch_size=4, tp=2)
    trainer = MegatronTrainer(spec_for("qwen3", hf_dir), config)
    batch = tp_batch()
    lp, ent = trainer.log_probs(batch, with_entropy=True)
    batch.old_log_probs = lp
    metrics = trainer.train_step(batch, local_loss)
    trainer.save(ckpt)
    exported = {k: v.clone() for bucket in trainer.export_hf(1 << 20) for k, v in bucket}
    trainer.train_step(batch, local_loss)
    after_two = {k: v.clone() for bucket in trainer.export_hf(1 << 20) for k, v in bucket}
    fresh = MegatronTrainer(spec_for("qwen3", hf_dir), config)
    fresh.load(ckpt)
    fresh.train_step(batch, local_loss)
    reloaded = {k: v.clone() for bucket in fresh.export_hf(1 << 20) for k, v in bucket}
    same = all(torch.equal(reloaded[k], after_two[k]) for k in after_two)
    if dist.get_rank() == 0:
        torch.save({"lp": lp, "ent": ent, "metrics": metrics, "params": exported, "reload_same": same}, out_file)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # dist-checkpointing starts worker processes: the guard is required
    main()
