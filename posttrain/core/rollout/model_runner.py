"""The forward passes of the local engine: a ``transformers`` causal LM run layer by layer over a static
KV cache with one slot per in-flight request.

The cache is two tensors ``k_cache, v_cache`` of shape ``[L, N, Hkv, S_max, D]`` (``L`` layers, ``N``
slots, ``Hkv`` KV heads, ``S_max`` the context length, ``D`` the head dim), allocated once. A request
owns one slot from prefill until it finishes; slot ``i`` holds its keys and values at positions
``0 .. len_i - 1``.

- **prefill** runs the prompts of newly admitted requests as one right-padded batch ``[n, P]`` with
  causal attention (right padding never leaks into valid positions under a causal mask) and writes
  their keys and values into their slots.
- **decode** runs one token for every slot ``0 .. nb - 1`` (``nb``: one past the highest busy slot;
  idle slots below it compute values nobody reads) at its own position ``pos_i``: the new key and
  value are written at ``pos_i`` and the query attends to cache positions ``<= pos_i``.

The weights, projections, norms, rotary embedding and MLP are the ``transformers`` modules of the
checkpoint's own class (Llama, Qwen2, Qwen3 and other models with the same decoder layout); only the
attention over the slot cache is ours. On CUDA the decode step over a fixed ``(nb, S_max)`` can be
captured in a CUDA graph per (batch bucket, span bucket) (``cuda_graphs=True``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

DEFAULT_MAX_CONTEXT = 4096


class ModelRunner:
    """Owns the model and its slot KV cache. Not thread-safe: the engine thread alone calls it."""

    def __init__(self, model_dir: str | Path | None, device: str = "cpu", dtype: str = "auto", max_slots: int = 32,
                 context_length: int | None = None, cuda_graphs: bool = False, model: Any = None):
        from transformers import AutoModelForCausalLM

        self.model_dir = str(model_dir) if model_dir is not None else None
        self.device = torch.device(device)
        if dtype == "auto":
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.dtype = getattr(torch, dtype)
        if model is None:  # ``model``: an already built HF model (benchmarks of random large shapes)
            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.hf_config = self.model.config
        cfg = self.hf_config
        self.layers = self.model.model.layers
        self.num_layers = len(self.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_kv_heads = cfg.num_key_value_heads
        self.scaling = attn.scaling
        self.vocab_size = cfg.vocab_size
        # default: the model's maximum, capped so a long-context model does not allocate a huge cache
        self.context_length = int(context_length or min(cfg.max_position_embeddings, DEFAULT_MAX_CONTEXT))
        self.max_slots = int(max_slots)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self._rope = apply_rotary_pos_emb
        shape = (self.num_layers, self.max_slots, self.num_kv_heads, self.context_length, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self._graphs: dict[tuple[int, int], tuple[Any, dict[str, torch.Tensor]]] = {}
        # graphs share one memory pool: they never run at the same time
        self._graph_pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None

    # -- weights --------------------------------------------------------------------------------
    def named_weights(self) -> dict[str, torch.Tensor]:
        """HF name -> tensor, tied weights listed under every name (``lm_head.weight`` included)."""
        return dict(self.model.state_dict(keep_vars=True))

    @torch.no_grad()
    def load_weights(self, named: dict[str, torch.Tensor]) -> list[str]:
        """Copy tensors into the model by HF name; returns names that matched nothing."""
        params = self.named_weights()
        missing = []
        for name, tensor in named.items():
            target = params.get(name)
            if target is None:
                missing.append(name)
                continue
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}")
            target.data.copy_(tensor.to(device=target.device, dtype=target.dtype))
        self._graphs.clear()  # graphs captured the old parameter storage only by pointer, but stay safe
        return missing

    # -- forward passes -------------------------------------------------------------------------
    def _attention_block(self, layer, h, positions, write, attend):
        """One decoder layer. ``h`` ``[n, q, hidden]``; ``positions`` ``[n, q]``; ``write(l, k, v)``
        stores new keys/values, ``attend(l, q)`` returns the attention output ``[n, H, q, D]``."""
        attn = layer.self_attn
        n, q_len, _ = h.shape
        x = layer.input_layernorm(h)
        shape = (n, q_len, -1, self.head_dim)
        q = attn.q_proj(x).view(shape)
        k = attn.k_proj(x).view(shape)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm on queries and keys before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, sin = self._cos_sin
        q, k = self._rope(q, k, cos, sin)
        write(attn.layer_idx, k, v)
        o = attend(attn.layer_idx, q, k, v)
        o = o.transpose(1, 2).reshape(n, q_len, -1)
        h = h + attn.o_proj(o)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    @torch.no_grad()
    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Run ``prompts`` into ``slots``; return the next-token logits ``[n, V]`` (float32)."""
        n = len(prompts)
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        width = int(lens.max())
        ids = torch.zeros((n, width), dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        positions = torch.arange(width, device=self.device)[None, :].expand(n, width)
        slot_idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        h = self.model.model.embed_tokens(ids)
        self._cos_sin = self.model.model.rotary_emb(h, positions)

        def write(l, k, v):
            self.k_cache[l, slot_idx, :, :width] = k
            self.v_cache[l, slot_idx, :, :width] = v

        def attend(l, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling, enable_gqa=True)

        for layer in self.layers:
            h = self._attention_block(layer, h, positions, write, attend)
        last = h[torch.arange(n, device=self.device), lens - 1]
        return self.model.lm_head(self.model.model.norm(last)).float()

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One step for slots ``0 .. nb - 1``: ``tokens``/``positions`` ``[nb]`` -> logits ``[nb, V]``."""
        if self.cuda_graphs:
            return self._decode_graphed(tokens, positions)
        span = int(positions.max()) + 1
        return self._decode_eager(tokens, positions, span)

    def _decode_eager(self, tokens, positions, span: int):
        nb = tokens.shape[0]
        rows = torch.arange(nb, device=self.device)
        h = self.model.model.embed_tokens(tokens[:, None])
        self._cos_sin = self.model.model.rotary_emb(h, positions[:, None])
        mask = (torch.arange(span, device=self.device)[None, :] <= positions[:, None])[:, None, None, :]

        def write(l, k, v):
            self.k_cache[l][rows, :, positions] = k[:, :, 0]
            self.v_cache[l][rows, :, positions] = v[:, :, 0]

        def attend(l, q, k, v):
            # GQA with one query token: the G query heads sharing a KV head become G query rows of that
            # head ([nb, Hkv, G, D]), so the kernel reads each cached K/V once instead of expanding it.
            kc = self.k_cache[l, :nb, :, :span]
            vc = self.v_cache[l, :nb, :, :span]
            heads = q.shape[1]
            qg = q.reshape(nb, self.num_kv_heads, heads // self.num_kv_heads, self.head_dim)
            o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=mask, scale=self.scaling)
            return o.reshape(nb, heads, 1, self.head_dim)

        for layer in self.layers:
            h = self._attention_block(layer, h, positions, write, attend)
        return self.model.lm_head(self.model.model.norm(h[:, 0])).float()

    def _bucket(self, nb: int) -> int:
        b = 1
        while b < nb:
            b *= 2
        return min(b, self.max_slots)

    def _span(self, positions) -> int:
        """Attention span of a graph: the longest context rounded up to 256 (capped at the context length)."""
        need = int(positions.max()) + 1
        return min(self.context_length, -(-need // 256) * 256)

    def _decode_graphed(self, tokens, positions):
        """CUDA-graph decode: one graph per (power-of-two batch bucket, 256-token span bucket)."""
        nb = tokens.shape[0]
        bucket = self._bucket(nb)
        span = self._span(positions)
        key = (bucket, span)
        if key not in self._graphs:
            static = {"tokens": torch.zeros(bucket, dtype=torch.long, device=self.device),
                      "positions": torch.zeros(bucket, dtype=torch.long, device=self.device)}
            # The warm-up runs for real and writes K/V at position 0 of slots 0 .. bucket-1, which may
            # belong to requests in flight: keep those cache entries and put them back afterwards.
            saved = (self.k_cache[:, :bucket, :, 0].clone(), self.v_cache[:, :bucket, :, 0].clone())
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up kernels outside the graph
                    self._decode_eager(static["tokens"], static["positions"], span)
            torch.cuda.current_stream().wait_stream(stream)
            self.k_cache[:, :bucket, :, 0] = saved[0]
            self.v_cache[:, :bucket, :, 0] = saved[1]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._graph_pool):
                static["logits"] = self._decode_eager(static["tokens"], static["positions"], span)
            self._graphs[key] = (graph, static)
        graph, static = self._graphs[key]
        static["tokens"][:nb].copy_(tokens)
        static["positions"][:nb].copy_(positions)
        if bucket > nb:
            static["positions"][nb:].zero_()
        graph.replay()
        return static["logits"][:nb]
