"""Our forward for the Llama family (Llama, Mistral, Qwen2, SmolLM2) over a paged KV cache.

The module tree comes from `quantkit.load` (float, packed int4 or fp8 linears, which
compute through `quantkit.ops`); the forward here is ours: all scheduled tokens of a
step run as one flat batch [T, hidden], new keys/values go into the paged cache with
`ops.kv_store`, prefill tokens attend with `ops.paged_prefill`, decode tokens with
`ops.paged_attention`, and logits are computed only for the tokens that are sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quantkit import ops
from quantkit.errors import QuantkitError
from quantkit.models.arch import arch_for, get_module

KV_DTYPES = {"float": torch.float8_e4m3fn, "int": torch.int8}


@dataclass(slots=True)
class Batch:
    """One step's tokens: prefill tokens first (sequence after sequence), then one decode
    token per decoding sequence."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    prefill_tables: torch.Tensor  # int32 [P, max_blocks]
    prefill_seq_lens: torch.Tensor  # int32 [P]
    prefill_query_lens: torch.Tensor  # int32 [P]
    decode_tables: torch.Tensor  # int32 [D, max_blocks]
    decode_seq_lens: torch.Tensor  # int32 [D]
    logits_indices: torch.Tensor  # int64 [num_sampled]: which of the T tokens are sampled

    @property
    def num_prefill_tokens(self) -> int:
        return int(self.prefill_query_lens.sum())


def kv_bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block across all layers."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * block_size * kv_heads * head_dim * dtype.itemsize


def kv_cache_dtype(model: nn.Module) -> torch.dtype:
    """The cache's dtype: fp8/int8 when the checkpoint has a KV-cache scheme, else the model's."""
    attention = get_module(get_module(model, arch_for(model.config).blocks)[0], arch_for(model.config).attention)
    args = getattr(getattr(attention, "quantkit_kv", None), "args", None)
    return KV_DTYPES[args.type] if args is not None else model.get_input_embeddings().weight.dtype


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class ModelRunner:
    """Owns the paged KV cache [layers] × [num_blocks, block_size, kv_heads, head_dim] and
    runs steps. KV is stored in the model's dtype, or fp8/int8 with the checkpoint's
    k_scale/v_scale when it has a `kv_cache_scheme`."""

    def __init__(self, model: nn.Module, num_blocks: int, block_size: int = 16):
        self.model, self.config = model, model.config
        self.spec = arch_for(model.config)
        self.blocks = list(get_module(model, self.spec.blocks))
        self.attn = [get_module(b, self.spec.attention) for b in self.blocks]
        c = self.config
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.scale = self.head_dim ** -0.5
        self.dtype = model.get_input_embeddings().weight.dtype
        self.device = model.get_input_embeddings().weight.device
        kv = getattr(self.attn[0], "quantkit_kv", None)
        self.kv_args = getattr(kv, "args", None)
        kv_dtype = kv_cache_dtype(model)
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=kv_dtype, device=self.device) for _ in self.blocks]
        self.v_cache = [torch.zeros(shape, dtype=kv_dtype, device=self.device) for _ in self.blocks]
        self.num_blocks, self.block_size = num_blocks, block_size

    def _scales(self, i: int):
        if self.kv_args is None:
            return None, None
        return self.attn[i].k_scale, self.attn[i].v_scale

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src's K/V into block dst, every layer."""
        if not pairs:
            return
        src, dst = (torch.tensor(x, device=self.device) for x in zip(*pairs))
        for k, v in zip(self.k_cache, self.v_cache):
            k[dst], v[dst] = k[src], v[src]

    def _rope(self, positions: torch.Tensor):
        dummy = torch.empty(0, dtype=self.dtype, device=self.device)
        cos, sin = get_module(self.model, self.spec.blocks.rsplit(".", 1)[0]).rotary_emb(dummy, positions[None])
        return cos[0, :, None, :], sin[0, :, None, :]  # [T, 1, head_dim]

    @torch.inference_mode()
    def forward(self, b: Batch) -> torch.Tensor:
        """fp32 logits [num_sampled, vocab] of the sampled tokens of the step."""
        T, P = b.input_ids.shape[0], b.num_prefill_tokens
        x = self.model.get_input_embeddings()(b.input_ids)  # x [T, hidden]
        cos, sin = self._rope(b.positions)
        for i, (block, attn) in enumerate(zip(self.blocks, self.attn)):
            h = block.input_layernorm(x)
            q = attn.q_proj(h).view(T, self.num_heads, self.head_dim)
            k = attn.k_proj(h).view(T, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(h).view(T, self.num_kv_heads, self.head_dim)
            q = (q * cos + _rotate_half(q) * sin).to(q.dtype)
            k = (k * cos + _rotate_half(k) * sin).to(k.dtype)
            k_scale, v_scale = self._scales(i)
            kc, vc = self.k_cache[i], self.v_cache[i]
            ops.kv_store(k, v, kc, vc, b.slot_mapping, k_scale, v_scale)
            out = torch.empty_like(q)
            if P:
                out[:P] = ops.paged_prefill(q[:P], kc, vc, b.prefill_tables, b.prefill_seq_lens,
                                            b.prefill_query_lens, self.scale, k_scale, v_scale)
            if P < T:
                out[P:] = ops.paged_attention(q[P:], kc, vc, b.decode_tables, b.decode_seq_lens, self.scale,
                                              k_scale, v_scale)
            x = x + attn.o_proj(out.view(T, -1))
            x = x + block.mlp(block.post_attention_layernorm(x))
        x = get_module(self.model, self.spec.final_norm)(x[b.logits_indices])
        return self.model.get_output_embeddings()(x).float()


def check_supported(model: nn.Module) -> None:
    """The engine runs the architectures of the table with standard RoPE attention."""
    arch_for(model.config)
    if getattr(model.config, "sliding_window", None) and getattr(model.config, "use_sliding_window", False):
        raise QuantkitError("sliding-window attention is not supported by the engine yet; use quantkit eval instead.")
