"""Time an advantage estimator + a policy loss (forward and backward) on a big batch; print ONE JSON line.

    python bench/losses.py                       # B=4096, T=4096, grpo + ppo_clip, CPU
    python bench/losses.py --estimator gae --loss gspo --aggregation seq-mean-token-mean --device cuda

Inputs are random with right padding (response lengths uniform in [1, T]), 16 samples per group.
Each stage is timed as the best of ``--repeats`` runs after one warm-up run.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", "-B", type=int, default=4096)
    parser.add_argument("--tokens", "-T", type=int, default=4096)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--estimator", default="grpo")
    parser.add_argument("--loss", default="ppo_clip")
    parser.add_argument("--aggregation", default=None, help="override the loss's aggregation mode")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    from posttrain.core.plugins import load_plugins
    from posttrain.core.types import AdvantageBatch

    plugins = load_plugins()
    est_cls, loss_cls = plugins.estimators.get_or_raise(args.estimator), plugins.losses.get_or_raise(args.loss)
    estimator = est_cls(est_cls.Config())
    loss_config = loss_cls.Config(**({"aggregation": args.aggregation} if args.aggregation else {}))
    loss_fn = loss_cls(loss_config)

    b, t, dev = args.batch, args.tokens, torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    old = -torch.rand(b, t, generator=gen) * 3
    log_probs = old + 0.05 * torch.randn(b, t, generator=gen)
    batch = AdvantageBatch(rewards=torch.randn(b, generator=gen).to(dev),
                           group_index=(torch.arange(b) // args.group_size).to(dev), response_mask=mask.to(dev),
                           values=(torch.randn(b, t, generator=gen) * mask).to(dev) if estimator.needs.critic else None,
                           metadata={"baseline_rewards": torch.randn(b, generator=gen).to(dev)})
    old, log_probs, mask = old.to(dev), log_probs.to(dev), mask.to(dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def timed(fn):
        fn()  # warm-up
        best = float("inf")
        for _ in range(args.repeats):
            sync()
            start = time.perf_counter()
            out = fn()
            sync()
            best = min(best, time.perf_counter() - start)
        return best, out

    adv_s, (advantages, _) = timed(lambda: estimator.advantages(batch))

    def loss_step():
        lp = log_probs.detach().requires_grad_(True)
        loss, metrics = loss_fn(lp, old, advantages, mask)
        loss.backward()
        return metrics

    loss_s, _ = timed(loss_step)
    tokens = int(mask.sum().item())
    print(json.dumps({
        "bench": "losses", "device": args.device, "threads": torch.get_num_threads(), "B": b, "T": t,
        "response_tokens": tokens, "estimator": args.estimator, "loss": args.loss,
        "aggregation": loss_fn.config.aggregation, "advantages_s": round(adv_s, 4),
        "loss_fwd_bwd_s": round(loss_s, 4), "total_s": round(adv_s + loss_s, 4),
        "tokens_per_s": round(b * t / (adv_s + loss_s)),
    }))


if __name__ == "__main__":
    main()
