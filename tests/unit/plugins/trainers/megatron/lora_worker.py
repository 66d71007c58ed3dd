"""Run under ``torchrun --nproc_per_node N`` (N = TP): the megatron trainer with LoRA adapters (every target, the
output layer too) on gloo; rank 0 saves what test_lora.py compares across TP sizes.

usage: lora_worker.py HF_DIR OUT_FILE CKPT_DIR
"""

from __future__ import annotations

import sys


def main() -> None:
    import torch
    import torch.distributed as dist

    from posttrain.core.plugins import load_plugins
    from posttrain.testing.contracts.trainer import contract_batch, run_config

    hf_dir, out_file, ckpt = sys.argv[1:4]
    torch.set_num_threads(1)
    plugins = load_plugins(autoload=False)
    cls = plugins.registry("trainers")["megatron"]
    backend = cls(cls.Config(tp=int(dist.get_world_size()) if dist.is_initialized() else 1))

    def build():
        run = run_config(backend, lr=2e-2, lr_warmup_steps=0, micro_batch_size=2, global_batch_size=4)
        run.trainer.lora.rank, run.trainer.lora.alpha = 4, 8.0
        run.trainer.lora.target_modules = ["q_proj", "o_proj", "gate_proj", "down_proj", "lm_head"]
        run.model.config.path = hf_dir
        return backend.build(run.model.create(plugins), run), run.loss.create(plugins)

    trainer, loss = build()
    backend.config.tp = trainer.tp_size
    batch = contract_batch()
    lp, ent = trainer.log_probs(batch, with_entropy=True)
    batch.old_log_probs, batch.ref_log_probs = lp, trainer.log_probs(batch, weights="ref")[0]
    metrics = [trainer.train_step(batch, loss) for _ in range(2)]  # the second moves A too (B is 0 at the first)
    lp2 = trainer.log_probs(batch)[0]
    trainer.save(ckpt)
    merged = {k: v.clone() for b in trainer.export_hf(1 << 20) for k, v in b}
    base = [(k, v.clone()) for b in trainer.export_update(1 << 20, True) for k, v in b]
    pairs = [(k, v.clone()) for b in trainer.export_update(1 << 20, False) for k, v in b]
    trainer.save_hf(ckpt + "-hf")
    third = trainer.train_step(batch, loss)
    fresh, _ = build()
    fresh.load(ckpt)
    resumed = fresh.train_step(batch, loss)
    same = all(torch.equal(p, q) for p, q in zip(trainer._params(), fresh._params()))
    grads = sorted({n for n, p in trainer.model.named_parameters() if p.grad is not None})
    state = len(trainer.optimizer.state)
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save({"lp": lp, "ent": ent, "metrics": metrics, "lp2": lp2, "merged": merged, "base": base,
                    "pairs": pairs, "third": third, "resumed": resumed, "resumed_same": same, "grads": grads,
                    "optimizer_states": state, "trainable": len(trainer._params())}, out_file)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
