"""KV-cache observation and fake quantization inside a transformers model.

Every family's attention (see `models/arch.py`) calls `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`
with keys and values after rotary and before the GQA repeat, [batch, kv_heads, seq, head_dim]
(with a cache: everything cached so far). `enable` registers one more implementation,
"quantkit_kv", that reads a `KVState` on the calling attention module, records per-head
|K| / |V| maxima and/or fake-quantizes K and V with the module's `k_scale` / `v_scale`
buffers, then runs transformers' own sdpa attention (with sdpa's masks; the family's eager
attention when it soft-caps the logits, which sdpa cannot), so with neither switched on
the model computes what it did before.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from quantkit.calibration.kv import check_kv_args, fake_quantize_kv, kv_scales
from quantkit.errors import QuantkitError
from quantkit.kernels.attention import twin as reference
from quantkit.models.arch import arch_for, get_module
from quantkit.scheme import QuantArgs

ATTN_IMPLEMENTATION = "quantkit_kv"
STATE_ATTR = "quantkit_kv"


@dataclass(slots=True)
class KVState:
    """What the attention function does for one attention module."""

    layer: int
    name: str  # e.g. "model.layers.3.self_attn"
    recording: bool = False
    k_amax: torch.Tensor | None = None  # [kv_heads] fp32, None until a token was seen
    v_amax: torch.Tensor | None = None
    args: QuantArgs | None = None  # set once quantize_kv was called

    def observe(self, key: torch.Tensor, value: torch.Tensor) -> None:
        k = key.detach().abs().amax(dim=(0, 2, 3)).float()  # [b, h, s, d] -> [h]
        v = value.detach().abs().amax(dim=(0, 2, 3)).float()
        self.k_amax = k if self.k_amax is None else torch.maximum(self.k_amax, k)
        self.v_amax = v if self.v_amax is None else torch.maximum(self.v_amax, v)


def _kv_attention_forward(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    state = getattr(module, STATE_ATTR, None)
    if state is not None and key.shape[2] > 0:
        if state.recording:
            state.observe(key, value)
        if state.args is not None:
            key = fake_quantize_kv(key, module.k_scale, state.args)
            value = fake_quantize_kv(value, module.v_scale, state.args)
    if kwargs.get("softcap") is not None:  # sdpa cannot cap logits (Gemma 2)
        return _capped_attention(query, key, value, attention_mask, kwargs["scaling"], kwargs["softcap"])
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _capped_attention(query, key, value, mask, scaling, softcap):
    """Softmax attention with logits softcap·tanh(q·kᵀ·scaling / softcap), as Gemma 2's eager
    attention computes it, under sdpa's mask (bool, True attends; None: plain causal).
    query [b, heads, q, d], key/value [b, kv_heads, k, d] -> [b, q, heads, d]."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # [b, h, q, k]
    scores = reference.cap(scores, softcap)
    q_len, k_len = scores.shape[-2:]
    if mask is None:
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(k_len - q_len)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    if AttentionInterface._global_mapping.get(ATTN_IMPLEMENTATION) is not _kv_attention_forward:
        AttentionInterface.register(ATTN_IMPLEMENTATION, _kv_attention_forward)
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def _attention_modules(model) -> list[tuple[str, torch.nn.Module]]:
    spec = arch_for(model.config)
    blocks = get_module(model, spec.blocks)
    return [(f"{spec.blocks}.{i}.{spec.attention}", get_module(b, spec.attention)) for i, b in enumerate(blocks)]


def enable(model) -> None:
    """Switch `model` (any family of `models/arch.py`) to the "quantkit_kv" attention and give every
    attention module a `KVState`. Idempotent; alone it changes no output."""
    modules = _attention_modules(model)  # raises for an architecture the table does not know
    _register()
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    for i, (name, attn) in enumerate(modules):
        if getattr(attn, "config", model.config)._attn_implementation != ATTN_IMPLEMENTATION:
            raise QuantkitError(f"{name} did not switch to the {ATTN_IMPLEMENTATION} attention; KV hooks need it.")
        if not isinstance(getattr(attn, STATE_ATTR, None), KVState):
            setattr(attn, STATE_ATTR, KVState(layer=i, name=name))


def _states(model) -> list[tuple[torch.nn.Module, KVState]]:
    pairs = [(attn, getattr(attn, STATE_ATTR, None)) for _, attn in _attention_modules(model)]
    if not pairs or any(not isinstance(s, KVState) for _, s in pairs):
        raise QuantkitError("the model has no KV hooks; call quantkit.models.kv_cache.enable(model) first.")
    return pairs


@contextlib.contextmanager
def record_kv_amax(model, reset: bool = True):
    """Record per-head max |K| and |V| of every forward run inside the block (enables the
    hooks if needed; `reset` forgets earlier recordings). Read them with `kv_amax`."""
    enable(model)
    states = [s for _, s in _states(model)]
    for s in states:
        if reset:
            s.k_amax = s.v_amax = None
        s.recording = True
    try:
        yield
    finally:
        for s in states:
            s.recording = False


def kv_amax(model) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """layer index -> (k_amax [kv_heads], v_amax [kv_heads]), fp32. A layer that saw no
    token is left out (`calibrated_scales` names it)."""
    return {s.layer: (s.k_amax, s.v_amax) for _, s in _states(model) if s.k_amax is not None}


def calibrated_scales(model, args: QuantArgs) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """layer index -> (k_scale, v_scale) from what `record_kv_amax` recorded (see `kv_scales`)."""
    check_kv_args(args)
    amax = kv_amax(model)
    for _, s in _states(model):
        if s.layer not in amax:
            raise QuantkitError(
                f"layer {s.layer} ({s.name}) saw no tokens during KV-cache calibration; "
                "run the calibration text through the model inside record_kv_amax(model)."
            )
    return {i: (kv_scales(k, args), kv_scales(v, args)) for i, (k, v) in amax.items()}


def _set_buffer(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    if name in module._buffers:
        del module._buffers[name]
    module.register_buffer(name, value)


def store_layer_scales(attn: torch.nn.Module, args: QuantArgs) -> None:
    """Give one attention module `k_scale` / `v_scale` buffers (fp32) from what its `KVState`
    recorded, without fake-quantizing later forwards: what `quantize_kv` stores for that
    layer, for a model calibrated (and written) one block at a time."""
    check_kv_args(args)
    s = getattr(attn, STATE_ATTR, None)
    if not isinstance(s, KVState) or s.k_amax is None:
        raise QuantkitError(
            f"{s.name if s else 'an attention module'} saw no tokens during KV-cache calibration; "
            "run the calibration text through it inside record_kv_amax(model)."
        )
    _set_buffer(attn, "k_scale", kv_scales(s.k_amax, args).detach().float().reshape(-1).clone())
    _set_buffer(attn, "v_scale", kv_scales(s.v_amax, args).detach().float().reshape(-1).clone())


def quantize_kv(model, scales: dict[int, tuple[torch.Tensor, torch.Tensor]], args: QuantArgs) -> None:
    """From now on fake-quantize K and V in every forward with `scales` (layer index ->
    (k_scale, v_scale), each [1] for strategy tensor or [kv_heads] for attn_head), and keep
    them as fp32 buffers `k_scale` / `v_scale` on each attention module (so they are in
    `model.state_dict()` as e.g. `model.layers.0.self_attn.k_scale`)."""
    check_kv_args(args)
    enable(model)
    pairs = _states(model)
    kv_heads = getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads
    want = 1 if args.strategy == "tensor" else kv_heads
    for attn, s in pairs:
        if s.layer not in scales:
            raise QuantkitError(f"no KV-cache scales for layer {s.layer} ({s.name}); calibrate every layer.")
        tensors = [*attn.parameters(), *attn.buffers()]  # packed linears hold buffers only
        device = tensors[0].device if tensors else torch.device("cpu")
        for buf, scale in zip(("k_scale", "v_scale"), scales[s.layer]):
            scale = torch.as_tensor(scale).detach().float().reshape(-1)
            if scale.numel() != want:
                raise QuantkitError(
                    f"{s.name}.{buf} has {scale.numel()} values; strategy {args.strategy!r} needs {want}."
                )
            _set_buffer(attn, buf, scale.clone().to(device))
        s.args = args
