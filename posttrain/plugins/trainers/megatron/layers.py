"""Layer pieces some families need beyond Megatron's local spec.

GLM-4 normalizes the *output* of attention and of the MLP before the residual add ("sandwich" norms:
``h = h + post_norm(attn(input_norm(h)))``). Megatron's ``TransformerLayer`` has no slot for that, so the
attention and MLP modules are wrapped: the wrapper runs the module and applies an RMSNorm named
``post_norm`` to its output (biases are off in these families, so ``(out, None)`` passes through).
"""

from __future__ import annotations

import copy


def _rms_norm_module():
    import torch
    from megatron.core.transformer.module import MegatronModule

    class RMSNorm(MegatronModule):
        """``y = w * (x / sqrt(mean(x^2) + eps))`` computed in fp32 (as HF does); a MegatronModule so
        dist-checkpointing sees its weight (a plain torch norm has no ``sharded_state_dict``)."""

        def __init__(self, config, hidden_size: int, eps: float):
            super().__init__(config=config)
            self.eps = eps
            self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

        def forward(self, x):
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * x32.to(x.dtype)

    return RMSNorm


def _with_post_norm(base: type) -> type:
    RMSNorm = _rms_norm_module()

    class PostNorm(base):  # type: ignore[misc, valid-type]
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            self.post_norm = RMSNorm(config, config.hidden_size, config.layernorm_epsilon)

        def forward(self, *args, **kwargs):
            out, bias = super().forward(*args, **kwargs)
            if bias is not None:
                out, bias = out + bias, None
            return self.post_norm(out), bias

    PostNorm.__name__ = PostNorm.__qualname__ = f"PostNorm{base.__name__}"
    return PostNorm


def with_post_norms(spec):
    """A copy of a local GPT layer spec whose attention and MLP outputs are RMS-normalized."""
    spec = copy.deepcopy(spec)
    sub = spec.submodules
    sub.self_attention.module = _with_post_norm(sub.self_attention.module)
    sub.mlp.module = _with_post_norm(sub.mlp.module)
    return spec
