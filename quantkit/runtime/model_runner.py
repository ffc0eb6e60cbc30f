"""Our forward for every family of `models/arch.py` over a paged KV cache.

The module tree comes from `quantkit.load` (float, packed int4 or fp8 linears, which
compute through `quantkit.ops`); the forward here is ours, and the family's description
says which norms, q/k norms and activation a block has: all scheduled tokens of a step run
as one flat batch [T, hidden] through each block's fused q/k/v and gate/up linears, new
keys/values go into the paged cache (the KV store), prefill tokens attend with the prefill
attention, all decode tokens together with the decode attention (each with the layer's scale,
sliding window and logit soft-cap), and logits are computed only for the tokens that are
sampled. The residual stream is added to in place, each add fused with the norm that follows
it; RMSNorms, rotary embedding and SiLU · up take the element-wise kernels (C++ on the CPU)
where the module computes what the twin does, checked once at load (`_Norm`, `_silu`), and the
module otherwise. A mixture-of-experts block routes with the model's own router and runs each
routed expert once on its tokens (`_SparseMLP`).

Every kernel is chosen once, at load, from its operation's candidates
(`quantkit.kernels.choice`; the quantized linears' `prepare`, the rest `ModelRunner._pick`),
and the forward calls the chosen callables with no checks. The notes (`kernel_notes`) are
those choices: what runs, and why faster candidates were passed over.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.kernels import attention, choice, cpu, dense, elementwise
from quantkit.kernels.attention import twin as attention_twin
from quantkit.kernels.choice import Choice, Problem
from quantkit.kernels.elementwise import twin as elementwise_twin
from quantkit.models import moe
from quantkit.models.arch import MoE, arch_for, get_module, unsupported_features
from quantkit.runtime.qlinear import fuse_linears, prepack

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
    num_prefill_tokens: int  # P: input_ids[:P] are prefill tokens, the rest decode tokens


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


def _probe(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A seeded random input of `like`'s dtype and device, to compare two ways of computing."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(shape, generator=g) * 2).to(like.device, like.dtype)


Pick = Callable[..., Callable]  # (op, candidates, **shapes) -> the chosen callable (`ModelRunner._pick`)


@dataclass(slots=True)
class _Norm:
    """An RMSNorm as the runner calls it: the chosen `rms_norm` kernel where the module computes
    Llama's or Gemma's RMSNorm exactly (`elementwise_twin.rms_norm`, checked once at load on a probe
    input), otherwise the module itself. `add_` is the residual add and the norm in one pass."""

    module: nn.Module
    fused: tuple[torch.Tensor, float, bool] | None  # (weight, eps, gemma), or None: the module
    rms: Callable | None = None  # (x, weight, eps, gemma) -> y
    add: Callable | None = None  # (x, delta, weight, eps, gemma) -> y, x += delta in place

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is None:
            return self.module(x)
        return self.rms(x, *self.fused)

    def add_(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """x += delta in place (the residual stream), then the norm of x."""
        if self.fused is None:
            return self.module(x.add_(delta))
        return self.add(x, delta, *self.fused)

    @classmethod
    def of(cls, module: nn.Module, like: torch.Tensor, pick: Pick) -> _Norm:
        """`module` as the runner calls it; `like`, an activation's dtype and device (the residual
        stream and the linears' outputs have it)."""
        weight = getattr(module, "weight", None)
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if isinstance(weight, torch.Tensor) and weight.dim() == 1 and isinstance(eps, float):
            x = _probe((4, weight.numel()), like)
            with torch.inference_mode():
                want = module(x)
                for gemma in (False, True):
                    if torch.equal(elementwise_twin.rms_norm(x, weight, eps, gemma), want):
                        rms = pick("rms_norm", elementwise.RMS_NORM, dtypes=(weight.dtype,))
                        add = pick("add_rms_norm_", elementwise.ADD_RMS_NORM, dtypes=(like.dtype, weight.dtype))
                        return cls(module, (weight, eps, gemma), rms, add)
        return cls(module, None)


def _silu(act: Callable[[torch.Tensor], torch.Tensor], like: torch.Tensor) -> bool:
    """Whether `act` is SiLU (the same values as torch's on a probe input of `like`'s dtype)."""
    x = _probe((4, 64), like)
    with torch.inference_mode():
        return torch.equal(act(x), torch.nn.functional.silu(x))


@dataclass(slots=True)
class _Layer:
    """One decoder block as the runner calls it: q/k/v and gate/up fused where they can be."""

    input_norm: _Norm
    qkv: Callable[[torch.Tensor], torch.Tensor]  # [T, hidden] -> [T, (heads + 2 kv_heads) * head_dim]
    o_proj: nn.Module
    post_attention_norm: Callable[[torch.Tensor], torch.Tensor]  # identity where the family has none
    pre_mlp_norm: _Norm
    mlp: Callable[[torch.Tensor], torch.Tensor]  # [T, hidden] -> [T, hidden]: `_MLP` or `_SparseMLP`
    post_mlp_norm: Callable[[torch.Tensor], torch.Tensor]
    q_norm: Callable[[torch.Tensor], torch.Tensor]  # per head, [T, heads, D]
    k_norm: Callable[[torch.Tensor], torch.Tensor]
    scale: float  # of q·k
    window: int | None  # sliding window (keys per query, itself included); None: all
    softcap: float | None  # attention logit soft-cap
    rope: str | None  # the layer type whose rotary tables it uses (Gemma 3), None: the one table
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    rope_: Callable  # the chosen kernels (`ModelRunner._cache_ops`): (x, cos, sin) -> None, in place
    kv_store: Callable  # (k, v, k_cache, v_cache, slots, k_scale, v_scale) -> None
    prefill: Callable  # (q, k_cache, v_cache, tables, seq_lens, query_lens, scale, k_scale, v_scale, window, softcap)
    decode: Callable  # (q, k_cache, v_cache, tables, seq_lens, scale, k_scale, v_scale, window, softcap)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _window(attention: nn.Module, config) -> int | None:
    """A layer's sliding window: its attention module's, else (Mistral, Mixtral, Phi-3 pass
    the config's to every layer) the config's unless its layer types make this layer a
    full-attention one (Qwen2-MoE); 0 means none."""
    if hasattr(attention, "sliding_window"):
        return attention.sliding_window or None
    types = getattr(config, "layer_types", None)
    if types and types[attention.layer_idx] != "sliding_attention":
        return None
    return getattr(config, "sliding_window", None) or None


@dataclass(slots=True)
class _MLP:
    """down(act(gate) * up), with gate and up from one fused projection."""

    gate_up: Callable[[torch.Tensor], torch.Tensor]  # [T, hidden] -> [T, 2 * intermediate]
    act: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]
    silu_mul: Callable | None  # act is SiLU: the chosen kernel for act(gate) * up in one pass

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.silu_mul is not None:
            return self.down(self.silu_mul(self.gate_up(x)))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)

    @classmethod
    def of(cls, gate_up: list[nn.Module], act, down: nn.Module, runner: ModelRunner) -> _MLP:
        """From the model's modules: gate and up, or one fused gate/up projection."""
        silu = runner._pick("silu_mul", elementwise.SILU_MUL) if _silu(act, runner._like) else None
        return cls(runner._linear(_projection(gate_up, runner), gate_up), act, runner._linear(down, [down]), silu)


@dataclass(slots=True)
class _SparseMLP:
    """A mixture-of-experts MLP: the model's own router gives each token its top-k experts
    and weights (normalised as the model does), the tokens are grouped by expert and each
    routed expert runs once on its tokens; the shared expert, when there is one, adds its
    output behind a sigmoid gate. Sums in expert order, as transformers adds them."""

    router: nn.Module  # x -> (logits, top-k weights [T, k], top-k experts [T, k])
    experts: list[_MLP]
    shared: _MLP | None
    shared_gate: nn.Module | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        _, weights, index = self.router(x)
        out = moe.mix(x, index, weights, self.experts)
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return out

    @classmethod
    def of(cls, block: nn.Module, spec: MoE, runner: ModelRunner) -> _SparseMLP:
        sparse = get_module(block, spec.module)
        gate, up, down = spec.names
        experts = [
            _MLP.of([getattr(x, gate), getattr(x, up)], x.act_fn, getattr(x, down), runner) for x in sparse.experts
        ]
        shared = None
        if spec.shared is not None:
            s = get_module(block, spec.shared)
            shared = _MLP.of([s.gate_proj, s.up_proj], s.act_fn, s.down_proj, runner)
        gate = None if spec.shared_gate is None else get_module(block, spec.shared_gate)
        return cls(get_module(block, spec.router), experts, shared, gate)


def _projection(modules: list[nn.Module], runner: ModelRunner) -> Callable[[torch.Tensor], torch.Tensor]:
    if len(modules) == 1:  # stored fused (Phi-3's qkv_proj, gate_up_proj)
        return modules[0]
    fused = fuse_linears(modules)
    if fused is not None:
        return fused
    parts = [runner._linear(m, [m]) for m in modules]
    return lambda x: torch.cat([m(x) for m in parts], dim=-1)


def _prepacked(module: nn.Module, originals: list[nn.Module]) -> nn.Module:
    """`prepack(module)`; when it is reordered, the float weights of `originals` (the model's
    linears it computes) become meta tensors, so they are not held twice. The model stays
    usable for its config and embeddings, not for its own forward."""
    packed = prepack(module)
    if packed is not module:
        for m in originals:
            m.weight = nn.Parameter(torch.empty_like(m.weight, device="meta"), requires_grad=False)
    return packed


class ModelRunner:
    """Owns the paged KV cache [layers] × [num_blocks, block_size, kv_heads, head_dim] and
    runs steps. KV is stored in the model's dtype, or fp8/int8 with the checkpoint's
    k_scale/v_scale when it has a `kv_cache_scheme`. At construction the q/k/v and gate/up
    linears of each block are fused (`fuse_linears`) where their kinds allow, and bf16 float
    linears on the CPU are reordered once for oneDNN (`prepack`; their weights in the model
    become meta tensors, so the model's own forward no longer runs)."""

    def __init__(
        self, model: nn.Module, num_blocks: int, block_size: int = 16, backend: str = "auto", max_num_seqs: int = 1
    ):
        choice.check_backend(backend)
        self.model, self.config, self.backend = model, model.config, backend
        self.max_num_seqs = max_num_seqs  # sequences a step may batch (the fp32 float linear's choice reads it)
        self.spec = arch_for(model.config)
        blocks = list(get_module(model, self.spec.blocks))
        c = self.config
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.dtype = model.get_input_embeddings().weight.dtype
        self.device = model.get_input_embeddings().weight.device
        attn = get_module(blocks[0], self.spec.attention)
        self.kv_args = getattr(getattr(attn, "quantkit_kv", None), "args", None)
        self.rotary_emb = get_module(model, self.spec.blocks.rsplit(".", 1)[0]).rotary_emb
        self._like = torch.empty(0, dtype=self.dtype, device=self.device)  # an activation's dtype and device
        self.linears: list[nn.Module] = []  # every linear the forward calls (fused, prepacked), in order
        self._linears: list[tuple[str, Choice]] = []  # each quantized linear's kernel, chosen by its `prepare`
        self._choices: dict[tuple, Choice] = {}  # the other operations' kernels, one per problem (`_pick`)
        kv_dtype = kv_cache_dtype(model)
        self.layers = [self._layer(b, kv_dtype) for b in blocks]
        self.embed = model.get_input_embeddings()
        self.final_norm = _Norm.of(get_module(model, self.spec.final_norm), self._like, self._pick)
        head = model.get_output_embeddings()
        self.lm_head = self._linear(
            head, [] if getattr(head, "weight", None) is self.embed.weight else [head]
        )  # tied: still looked up
        self.final_softcap = getattr(c, "final_logit_softcapping", None)
        self.argmax = self._pick("argmax", elementwise.ARGMAX)  # the greedy sampler's, on the logits
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        # on the CPU on 2 MB pages (a decode step streams the blocks from scattered places)
        self.k_cache = [cpu.zeros(shape, kv_dtype, self.device) for _ in blocks]
        self.v_cache = [cpu.zeros(shape, kv_dtype, self.device) for _ in blocks]
        self.num_blocks, self.block_size = num_blocks, block_size

    def _pick(self, op: str, candidates: list, **shapes) -> Callable:
        """The callable chosen for `op` (`quantkit.kernels.choice.choose`) on the runner's device,
        dtype and backend with `shapes`; each distinct problem is chosen once, and kept for the
        notes."""
        return self._chosen(op, candidates, **shapes).fn

    def _chosen(self, op: str, candidates: list, **shapes) -> Choice:
        key = (op, tuple(sorted(shapes.items())))
        if key not in self._choices:
            problem = Problem(self.device, self.dtype, self.backend, **shapes)
            self._choices[key] = choice.choose(op, candidates, problem)
        return self._choices[key]

    def _linear(self, module, originals: list[nn.Module]) -> Callable[[torch.Tensor], torch.Tensor]:
        """`module` as the runner calls it: a quantized linear's chosen kernel (its `prepare`), a
        bf16 float linear reordered for oneDNN (`_prepacked`), an fp32 one on the CPU through the
        float-linear kernel chosen once (`dense.LINEAR`), else the module."""
        if hasattr(module, "prepare"):
            self._linears.append((type(module).__name__, module.prepare(self.dtype, self.device, self.backend)))
            self.linears.append(module)
            return module.run
        module = _prepacked(module, originals)
        if isinstance(module, nn.Module):
            self.linears.append(module)
        if type(module) is nn.Linear and module.weight.dtype == torch.float32 and self.device.type == "cpu":
            chosen = self._chosen("float linear", dense.LINEAR, max_num_seqs=self.max_num_seqs)
            fn = chosen.fn(module.weight, module.bias)
            if chosen.name == dense.PACKED:  # its copy replaces the plain weights (a tied head's embedding stays)
                dense.release([module, *originals])
            return fn
        return module

    @property
    def kernels(self) -> list[tuple[str, Choice]]:
        """What runs: [(the kind of linear or the operation, its `Choice`)], as chosen at load."""
        return self._linears + [(k.op, k) for k in self._choices.values()]

    def kernel_notes(self) -> list[str]:
        """One line per kernel that is not the fastest of its operation's candidates, saying why
        the faster ones were passed over (from the choices themselves: what they name runs)."""
        counts = Counter((what, k.name, k.why) for what, k in self._linears if k.why)
        notes = [
            f"{n} {what} {'layers run' if n > 1 else 'layer runs'} on {name}: {why}."
            for (what, name, why), n in counts.items()
        ]
        ops: dict[tuple[str, str], list[str]] = {}
        for k in self._choices.values():
            if k.why and k.op not in ops.setdefault((k.name, k.why), []):
                ops[(k.name, k.why)].append(k.op)
        for (name, why), names in ops.items():
            notes.append(f"{', '.join(names)} {'run' if len(names) > 1 else 'runs'} on {name}: {why}.")
        return notes

    def _layer(self, block: nn.Module, kv_dtype: torch.dtype) -> _Layer:
        spec = self.spec.for_block(block)
        qkv, o = spec.sequential[:2]  # q/k/v (fused or not), o
        mods = lambda names: [get_module(block, n) for n in names]  # noqa: E731

        def norm(name: str | None):
            return _identity if name is None else _Norm.of(get_module(block, name), self._like, self._pick)

        attn = get_module(block, spec.attention)
        scales = (attn.k_scale, attn.v_scale) if self.kv_args is not None else (None, None)
        qkv_mods, o_proj = mods(qkv), get_module(block, o[0])
        if spec.moe is not None:
            mlp = _SparseMLP.of(block, spec.moe, self)
        else:
            gate_up, down = spec.sequential[2:]  # gate/up (fused or not), down
            mlp = _MLP.of(mods(gate_up), get_module(block, spec.act), get_module(block, down[0]), self)
        takes_layer_type = "layer_type" in inspect.signature(self.rotary_emb.forward).parameters
        window, softcap = _window(attn, self.config), getattr(attn, "attn_logit_softcapping", None)
        attention_twin.check_window_softcap("paged_attention", window, softcap)
        rope = getattr(attn, "layer_type", None) if takes_layer_type else None
        return _Layer(
            norm(spec.input_norm),
            self._linear(_projection(qkv_mods, self), qkv_mods),
            self._linear(o_proj, [o_proj]),
            norm(spec.post_attention_norm),
            norm(spec.pre_mlp_norm),
            mlp,
            norm(spec.post_mlp_norm),
            norm(spec.q_norm),
            norm(spec.k_norm),
            attn.scaling,
            window,
            softcap,
            rope,
            *scales,
            *self._cache_ops(kv_dtype, scales, rope),
        )

    def _cache_ops(self, kv_dtype: torch.dtype, scales: tuple, rope: str | None) -> tuple[Callable, ...]:
        """A layer's kernels for rotary embedding, the KV store, prefill and decode attention."""
        cos, sin = self._rope_tables(torch.zeros(1, dtype=torch.long, device=self.device), rope)
        attention_shapes = {"head_dim": self.head_dim, "num_heads": self.num_heads, "kv_dtype": kv_dtype}
        scale_dtypes = tuple(s.dtype for s in scales if s is not None)
        return (
            self._pick("rope_", elementwise.ROPE, dtypes=(cos.dtype, sin.dtype)),
            self._pick("KV store", attention.KV_STORE, **attention_shapes, scales=scale_dtypes),
            self._pick("prefill attention", attention.PREFILL, **attention_shapes),
            self._pick("decode attention", attention.DECODE, **attention_shapes),
        )

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src's K/V into block dst, every layer."""
        if not pairs:
            return
        src, dst = (torch.tensor(x, device=self.device) for x in zip(*pairs))
        for k, v in zip(self.k_cache, self.v_cache):
            k[dst], v[dst] = k[src], v[src]

    def _rope_tables(self, positions: torch.Tensor, layer_type: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin [T, rotary_dim] for the rotary kernel (`_Layer.rope_`)."""
        dummy = torch.empty(0, dtype=self.dtype, device=self.device)
        extra = () if layer_type is None else (layer_type,)
        cos, sin = self.rotary_emb(dummy, positions[None], *extra)
        half = cos.shape[-1] // 2
        sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
        return cos[0].contiguous(), sin

    def _attention(self, b: Batch, q: torch.Tensor, i: int, layer: _Layer) -> torch.Tensor:
        P, T = b.num_prefill_tokens, q.shape[0]
        kc, vc, ks, vs = self.k_cache[i], self.v_cache[i], layer.k_scale, layer.v_scale
        window, softcap, parts = layer.window, layer.softcap, []
        if P:
            tables, lens, query_lens = b.prefill_tables, b.prefill_seq_lens, b.prefill_query_lens
            parts.append(layer.prefill(q[:P], kc, vc, tables, lens, query_lens, layer.scale, ks, vs, window, softcap))
        if P < T:
            tables, lens = b.decode_tables, b.decode_seq_lens
            parts.append(layer.decode(q[P:], kc, vc, tables, lens, layer.scale, ks, vs, window, softcap))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    @torch.inference_mode()
    def forward(self, b: Batch) -> torch.Tensor:
        """Logits [num_sampled, vocab] of the sampled tokens of the step, in the model's dtype."""
        T, H, KV, D = b.input_ids.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        x = self.embed(b.input_ids)  # [T, hidden]
        tables = {rope: self._rope_tables(b.positions, rope) for rope in {layer.rope for layer in self.layers}}
        h = self.layers[0].input_norm(x)  # x, the residual stream, is added to in place
        for i, layer in enumerate(self.layers):
            cos, sin = tables[layer.rope]
            qkv = layer.qkv(h)  # [T, (H + 2 KV) D]
            q = layer.q_norm(qkv[:, : H * D].view(T, H, D))
            k = layer.k_norm(qkv[:, H * D : (H + KV) * D].view(T, KV, D))
            layer.rope_(q, cos, sin)
            layer.rope_(k, cos, sin)
            v = qkv[:, (H + KV) * D :].view(T, KV, D)
            layer.kv_store(k, v, self.k_cache[i], self.v_cache[i], b.slot_mapping, layer.k_scale, layer.v_scale)
            out = layer.post_attention_norm(layer.o_proj(self._attention(b, q, i, layer).view(T, H * D)))
            h = layer.pre_mlp_norm.add_(x, out)
            out = layer.post_mlp_norm(layer.mlp(h))
            if i + 1 < len(self.layers):
                h = self.layers[i + 1].input_norm.add_(x, out)
            else:
                x.add_(out)
        logits = self.lm_head(self.final_norm(x[b.logits_indices]))
        return attention_twin.cap(logits, self.final_softcap)


def check_supported(model: nn.Module) -> None:
    """The engine runs every family of the table; a config setting its forward does not
    implement is refused by name rather than served wrongly."""
    arch_for(model.config)
    found = unsupported_features(model.config)
    if found:
        raise QuantkitError(
            f"the engine does not implement {', '.join(found)} of this {model.config.model_type} model; "
            "quantkit eval and quantize still work on it (through transformers)."
        )
