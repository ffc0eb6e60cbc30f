"""Model knowledge as data: one description per family of where its decoder blocks,
linears and norms live, how AWQ balances them, and which block features it has. The
calibration runner and methods, the KV-cache hooks, the engine's forward and `plan` all
read it. A family shaped like an existing one is one table entry (docs/architectures.md).

Every family here runs one block forward in the engine (`runtime/model_runner.py`):

    x = x + post_attention_norm(o_proj(attention(rope(q_norm(q)), rope(k_norm(k)), v)))
    x = x + post_mlp_norm(down_proj(act(gate) * up))    with gate, up = gate_up(pre_mlp_norm(x))

where a norm the family does not have is the identity, and the attention's scale, sliding
window and logit soft-cap come from the model's own attention modules and config. In a
mixture-of-experts block (`MoE`) the MLP is the model's own router choosing top-k experts,
each expert the MLP above on the tokens routed to it, plus an optional shared expert behind
a sigmoid gate; `ArchSpec.for_block` lists a sparse block's expert linears one by one."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from quantkit.errors import QuantkitError


@dataclass(frozen=True)
class Mapping:
    """An AWQ balance: scaling `prev` by 1/s and the inputs of `linears` by s keeps the function."""

    prev: str  # a norm or linear inside the block whose output feeds `linears`
    linears: tuple[str, ...]
    # the module whose output the scale search minimises the error of (run on whole
    # calibration sequences); None: the linears' own outputs
    inspect: str | None = None
    # which output rows of a fused `prev` feed the linears: "v" (the values of a fused
    # q/k/v projection) or "up" (the second half of a fused gate/up projection); None: all
    prev_rows: str | None = None
    # the module whose input is the linears' input (`prev`'s output); None: the first linear's.
    # A sparse MLP's experts each read only their routed tokens; the MLP reads them all
    input: str | None = None
    # float modules that also read `prev`'s output: their weight columns take the scale too
    # (a router, a shared expert's gate), so folding keeps the function; never quantized
    readers: tuple[str, ...] = ()


@dataclass(frozen=True)
class MoE:
    """Where a family's sparse MLP keeps its parts (paths from a block, as in its checkpoints).

    The router is `{module}.gate` (its `forward(x)` returns logits, top-k weights and top-k
    expert indices, normalised the model's way) and the experts `{module}.experts.N.{name}`
    for name in `names` (gate, up, down). quantkit holds one nn.Linear per expert
    (`models/moe.py`) where transformers holds them fused."""

    module: str
    names: tuple[str, str, str]  # an expert's gate, up and down projections
    shared: str | None = None  # a shared expert every token goes through (an MLP with gate/up/down_proj)
    shared_gate: str | None = None  # its gate: a linear to one output, through a sigmoid
    alias: str | None = None  # the attribute the block's forward calls the module by, when not `module`

    @property
    def router(self) -> str:
        return f"{self.module}.gate"

    def expert(self, index: int, part: int) -> str:
        return f"{self.module}.experts.{index}.{self.names[part]}"

    def is_expert(self, name: str) -> bool:
        """Whether the block linear `name` belongs to a routed expert (not the shared one)."""
        return name.startswith(f"{self.module}.experts.")


@dataclass(frozen=True)
class ArchSpec:
    """Where a family keeps things (attribute paths from the model or from a block)."""

    blocks: str  # attribute path of the decoder block list
    embed: str
    final_norm: str
    lm_head: str
    # linears of one block in the order their inputs become available (true-sequential
    # groups; the engine reads them as q/k/v, o, gate/up, down); one group's linears read
    # the same input; a fused linear is a group of one
    sequential: tuple[tuple[str, ...], ...]
    awq: tuple[Mapping, ...]
    attention: str  # the attention module inside a block (KV-cache hooks, scale, window)
    input_norm: str = "input_layernorm"
    post_attention_norm: str | None = None  # on the attention's output (Gemma's sandwich norms)
    pre_mlp_norm: str = "post_attention_layernorm"
    post_mlp_norm: str | None = None
    q_norm: str | None = None  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    k_norm: str | None = None
    act: str = "mlp.act_fn"
    norm_offset: float = 0.0  # the norms scale by (offset + weight): Gemma's are (1 + w)
    moe: MoE | None = None  # the sparse MLP of a mixture-of-experts family
    # the sequential groups in passes over the calibration batches, when a pass holds several:
    # no group of a pass changes another's inputs (every expert's gate/up, then every down)
    passes: tuple[tuple[tuple[str, ...], ...], ...] = ()
    # (linear, out, in) of a dense block's linears in the widths `dimensions` reads from a
    # config (`plan` sizes a model by them without building it); `block_shapes` adds the experts'
    shapes: tuple[tuple[str, str, str], ...] = ()

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(name for group in self.sequential for name in group)

    @property
    def stages(self) -> tuple[tuple[tuple[str, ...], ...], ...]:
        """The sequential groups pass by pass (one group a pass in a dense block)."""
        return self.passes or tuple((group,) for group in self.sequential)

    def for_block(self, block) -> ArchSpec:
        """The spec of one decoder block: in a sparse block every expert's linears are named
        (`experts.N.gate_proj`, ...) with their AWQ mappings; a dense block of a sparse family
        (Qwen's `mlp_only_layers`) has the family's dense MLP."""
        if self.moe is None:
            return self
        experts = getattr(get_module(block, self.moe.module), "experts", None)
        if experts is None:
            return self.replace(moe=None)
        return self.sparse(len(experts))

    def sparse(self, experts: int) -> ArchSpec:
        """The spec of a sparse block of this family whose MLP has `experts` experts."""
        return _sparse(self, experts)

    def replace(self, **changes) -> ArchSpec:
        return dataclasses.replace(self, **changes)


LLAMA = ArchSpec(
    blocks="model.layers",
    embed="model.embed_tokens",
    final_norm="model.norm",
    lm_head="lm_head",
    sequential=(
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp.down_proj",),
    ),
    awq=(
        Mapping("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), inspect="self_attn"),
        Mapping("self_attn.v_proj", ("self_attn.o_proj",)),
        Mapping("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), inspect="mlp"),
        Mapping("mlp.up_proj", ("mlp.down_proj",)),
    ),
    attention="self_attn",
    shapes=(
        ("self_attn.q_proj", "q", "hidden"),
        ("self_attn.k_proj", "kv", "hidden"),
        ("self_attn.v_proj", "kv", "hidden"),
        ("self_attn.o_proj", "hidden", "q"),
        ("mlp.gate_proj", "mlp", "hidden"),
        ("mlp.up_proj", "mlp", "hidden"),
        ("mlp.down_proj", "hidden", "mlp"),
    ),
)

QWEN3 = LLAMA.replace(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")

GEMMA2 = LLAMA.replace(
    awq=(
        *LLAMA.awq[:2],
        Mapping("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), inspect="mlp"),
        LLAMA.awq[3],
    ),
    post_attention_norm="post_attention_layernorm",
    pre_mlp_norm="pre_feedforward_layernorm",
    post_mlp_norm="post_feedforward_layernorm",
    norm_offset=1.0,
)

GEMMA3 = GEMMA2.replace(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")

PHI3 = LLAMA.replace(
    sequential=(("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",)),
    awq=(
        Mapping("input_layernorm", ("self_attn.qkv_proj",), inspect="self_attn"),
        Mapping("self_attn.qkv_proj", ("self_attn.o_proj",), prev_rows="v"),
        Mapping("post_attention_layernorm", ("mlp.gate_up_proj",), inspect="mlp"),
        Mapping("mlp.gate_up_proj", ("mlp.down_proj",), prev_rows="up"),
    ),
    act="mlp.activation_fn",
    shapes=(
        ("self_attn.qkv_proj", "qkv", "hidden"),
        ("self_attn.o_proj", "hidden", "q"),
        ("mlp.gate_up_proj", "gate_up", "hidden"),
        ("mlp.down_proj", "hidden", "mlp"),
    ),
)

# The sparse families: Mixtral's MLP is `block_sparse_moe` in its checkpoints (transformers 5
# renames it `mlp` in memory); the Qwen MoEs keep `mlp`, and Qwen2-MoE adds a shared expert.
# Their dense layers (Qwen's mlp_only_layers) are Llama's / Qwen3's.
MIXTRAL = LLAMA.replace(moe=MoE("block_sparse_moe", ("w1", "w3", "w2"), alias="mlp"))
QWEN3_MOE = QWEN3.replace(moe=MoE("mlp", ("gate_proj", "up_proj", "down_proj")))
QWEN2_MOE = LLAMA.replace(
    moe=dataclasses.replace(QWEN3_MOE.moe, shared="mlp.shared_expert", shared_gate="mlp.shared_expert_gate")
)


def _sparse(spec: ArchSpec, n: int) -> ArchSpec:
    """`spec` for a block whose MLP has `n` experts: attention as the family's; then, in one
    pass, every expert's gate/up (and the shared expert's); then, in one pass, every down.
    AWQ: one scale for all gate/up inputs, folded into the norm (router and shared gate
    compensated), and one up -> down scale per expert."""
    moe = spec.moe
    shared = () if moe.shared is None else tuple(f"{moe.shared}.{n}" for n in ("gate_proj", "up_proj", "down_proj"))
    gate_up = tuple((moe.expert(e, 0), moe.expert(e, 1)) for e in range(n)) + ((shared[:2],) if shared else ())
    down = tuple((moe.expert(e, 2),) for e in range(n)) + ((shared[2:],) if shared else ())
    attention = spec.sequential[:2]
    readers = (moe.router,) + ((moe.shared_gate,) if moe.shared_gate else ())
    mlp = Mapping(
        spec.pre_mlp_norm, tuple(x for g in gate_up for x in g), inspect=moe.module, input=moe.module, readers=readers
    )
    return spec.replace(
        sequential=attention + gate_up + down,
        passes=tuple((g,) for g in attention) + (gate_up, down),
        awq=spec.awq[:2] + (mlp,) + tuple(Mapping(g[1], d) for g, d in zip(gate_up, down)),
    )


# model_type -> spec. Mistral, Qwen2 (q/k/v with bias) and Llama 3 (its rope scaling is in
# the model's rotary embedding) share Llama's layout.
ARCHS: dict[str, ArchSpec] = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": QWEN3,
    "gemma2": GEMMA2,
    "gemma3_text": GEMMA3,
    "phi3": PHI3,
    "mixtral": MIXTRAL,
    "qwen2_moe": QWEN2_MOE,
    "qwen3_moe": QWEN3_MOE,
}
FAMILIES = (
    "Llama (1, 2, 3.x), Mistral, Qwen2/2.5, Qwen3, Gemma 2, Gemma 3 (text), Phi-3/Phi-4, Mixtral, Qwen2-MoE, Qwen3-MoE"
)


def arch_for(config) -> ArchSpec:
    """The spec of a transformers config (or a config.json dict), or a `QuantkitError` naming
    the supported ones."""
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    if model_type not in ARCHS:
        raise QuantkitError(
            f"architecture {model_type!r} is not supported yet; quantkit supports {FAMILIES} "
            f"(model types {', '.join(sorted(ARCHS))}); docs/architectures.md says how to add one."
        )
    return ARCHS[model_type]


def _mlp_shapes(width: str) -> tuple[tuple[str, str], ...]:
    """(out, in) of an expert's (or the shared expert's) gate, up and down projections."""
    return (width, "hidden"), (width, "hidden"), ("hidden", width)


def dimensions(config: dict) -> dict[str, int]:
    """The widths the families' linear shapes are written in (`ArchSpec.shapes`), from a
    config.json dict: hidden, head_dim, q (heads × head_dim), kv (KV heads × head_dim), qkv (fused),
    mlp (a dense MLP's width), gate_up (fused), expert and shared (a sparse MLP's expert and
    shared expert; 0: none)."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    hd = config.get("head_dim") or h // heads
    mlp = config["intermediate_size"]
    return {
        "hidden": h,
        "head_dim": hd,
        "q": heads * hd,
        "kv": kv_heads * hd,
        "qkv": (heads + 2 * kv_heads) * hd,
        "mlp": mlp,
        "gate_up": 2 * mlp,
        "expert": config.get("moe_intermediate_size") or mlp,
        "shared": config.get("shared_expert_intermediate_size") or 0,
    }


def num_experts(config: dict) -> int:
    """Experts per sparse MLP of a config.json dict (Mixtral's num_local_experts, the Qwen
    MoEs' num_experts); 0: a dense model."""
    return config.get("num_local_experts") or config.get("num_experts") or 0


def sparse_layers(config: dict) -> list[bool]:
    """Per decoder layer of a config.json dict, whether its MLP is sparse: every layer of a
    mixture of experts, but for Qwen's mlp_only_layers and the layers decoder_sparse_step skips."""
    layers, step = config["num_hidden_layers"], config.get("decoder_sparse_step") or 1
    dense = set(config.get("mlp_only_layers") or ())
    return [bool(num_experts(config)) and i not in dense and (i + 1) % step == 0 for i in range(layers)]


def block_shapes(spec: ArchSpec, config: dict, sparse: bool = False) -> dict[str, tuple[int, int]]:
    """Linear (as `for_block` names it) -> [out, in] of one decoder block of the model the
    config.json dict describes: a dense block, or with `sparse` one whose MLP has the
    config's experts (each named, and the shared expert)."""
    dims = dimensions(config)
    if not sparse or spec.moe is None:
        return {name: (dims[o], dims[i]) for name, o, i in spec.shapes}
    moe, n = spec.moe, num_experts(config)
    block = spec.sparse(n)
    found = {name: (dims[o], dims[i]) for name, o, i in spec.shapes if name in block.linears}
    for part, (o, i) in enumerate(_mlp_shapes("expert")):
        found |= {moe.expert(e, part): (dims[o], dims[i]) for e in range(n)}
    if moe.shared:
        parts = zip(("gate_proj", "up_proj", "down_proj"), _mlp_shapes("shared"))
        found |= {f"{moe.shared}.{name}": (dims[o], dims[i]) for name, (o, i) in parts}
    return {name: found[name] for name in block.linears}


ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # static tables: the rotary module's cos/sin hold for any batch
LAYER_TYPES = ("full_attention", "sliding_attention")


def unsupported_features(config) -> list[str]:
    """The config settings the engine's forward does not implement, each as 'field=value'
    (empty when it runs the model as transformers does)."""
    found = []
    for params in _rope_parameters(config):
        if params.get("rope_type", "default") not in ROPE_TYPES:
            found.append(f"rope_type={params['rope_type']!r}")
    for layer_type in set(getattr(config, "layer_types", None) or ()):
        if layer_type not in LAYER_TYPES:
            found.append(f"layer_types containing {layer_type!r}")
    for field in ("use_bidirectional_attention", "attention_chunk_size", "no_rope_layers"):
        if getattr(config, field, None):
            found.append(f"{field}={getattr(config, field)!r}")
    return found


def _rope_parameters(config) -> list[dict]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):  # one per layer type (Gemma 3)
        return list(params.values())
    return [params] if params else []


def get_module(root, path: str):
    for part in path.split("."):
        root = getattr(root, part)
    return root
