"""Model knowledge as data: where the decoder blocks, linears and norms of each
supported architecture live. Adding an architecture means adding an entry here."""

from __future__ import annotations

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


@dataclass(frozen=True)
class ArchSpec:
    blocks: str  # attribute path of the decoder block list
    embed: str
    final_norm: str
    lm_head: str
    # linears of one block in the order their inputs become available (true-sequential
    # groups); the linears of one group read the same input
    sequential: tuple[tuple[str, ...], ...]
    awq: tuple[Mapping, ...]
    attention: str  # the attention module inside a block (for KV-cache hooks)

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(name for group in self.sequential for name in group)


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
)

# model_type -> spec. Mistral and Qwen2 (q/k/v with bias) share Llama's layout.
ARCHS: dict[str, ArchSpec] = {"llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA}


def arch_for(config) -> ArchSpec:
    """The spec of a transformers config, or a `QuantkitError` naming the supported ones."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHS:
        raise QuantkitError(
            f"architecture {model_type!r} is not supported yet; quantkit supports {', '.join(sorted(ARCHS))}."
        )
    return ARCHS[model_type]


def get_module(root, path: str):
    for part in path.split("."):
        root = getattr(root, part)
    return root
