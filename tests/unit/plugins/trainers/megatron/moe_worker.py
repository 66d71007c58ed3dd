"""Run under ``torchrun --nproc_per_node 2``: MoE checkpoints on two ranks; rank 0 saves the results.

usage: moe_worker.py OUT_FILE tp QWEN3_MOE_DIR GLM4_MOE_DIR   -- verify both at TP=2
       moe_worker.py OUT_FILE ep QWEN3_MOE_DIR                -- verify at EP=2 (x DP=2), then the trainer at
                                                                 EP=2: each rank takes half the batch
       moe_worker.py OUT_FILE init-ep                         -- no checkpoint: the weights seeded initialization
                                                                 draws (seed 3) at EP=2, qwen3_moe and glm4_moe
       moe_worker.py OUT_FILE init-pp                         -- the same at PP=2 for a 4-layer glm4_moe (the second
                                                                 stage holds no dense layer)
"""

from __future__ import annotations

import sys


def glm4_moe_4_layers():
    """The tiny glm4_moe preset with 4 layers (1 dense, 3 MoE): two per pipeline stage at PP=2."""
    from posttrain.core.plugins import load_plugins

    cls = load_plugins().registry("model")["glm4_moe"]
    return cls(cls.Config(preset="tiny", dtype="float32", overrides={"num_hidden_layers": 4}))


def main() -> None:
    import torch
    import torch.distributed as dist

    from posttrain.plugins.trainers.megatron.convert import verify_checkpoint
    from posttrain.plugins.trainers.megatron.model import init_parallel
    from train_helpers import local_loss, spec_for, tp_batch, trainer_configs

    out_file, mode, *dirs = sys.argv[1:]
    torch.set_num_threads(1)
    if mode == "init-pp":
        from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer

        init_parallel(1, 2)
        trainer = MegatronTrainer(glm4_moe_4_layers(), **trainer_configs(pp=2), seed=3)
        results = {k: v.clone() for bucket in trainer.export_hf(1 << 20) for k, v in bucket}
    elif mode == "init-ep":
        from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer

        init_parallel(1, 1, ep=2)
        results = {}
        for family in ("qwen3_moe", "glm4_moe"):
            trainer = MegatronTrainer(spec_for(family), **trainer_configs(ep=2), seed=3)
            results[family] = {k: v.clone() for bucket in trainer.export_hf(1 << 20) for k, v in bucket}
    elif mode == "tp":
        init_parallel(2, 1)
        results = {family: verify_checkpoint(spec_for(family, path), path, attention="sdpa")
                   for family, path in zip(("qwen3_moe", "glm4_moe"), dirs)}
    else:
        from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer

        (path,) = dirs
        init_parallel(1, 1, ep=2)
        results = {"verify": verify_checkpoint(spec_for("qwen3_moe", path), path, attention="sdpa")}
        trainer = MegatronTrainer(spec_for("qwen3_moe", path), **trainer_configs(
            lr=1e-3, micro_batch_size=1, global_batch_size=4, ep=2))
        batch = tp_batch()  # every rank is given the whole batch and takes its replica's share
        batch.old_log_probs = trainer.log_probs(batch)[0]  # gathered back: [4, T] on every rank
        metrics = trainer.train_step(batch, local_loss)  # reduced over DP: the whole step's
        exported = {k: v.clone() for bucket in trainer.export_hf(1 << 20) for k, v in bucket}
        results.update(lp=batch.old_log_probs, loss=metrics["loss"], metrics=metrics,
                       params=exported, local_experts=trainer.gpt.decoder.layers[0].mlp.experts.num_local_experts)
    if dist.get_rank() == 0:
        torch.save(results, out_file)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # dist-checkpointing starts worker processes: the guard is required
    main()
