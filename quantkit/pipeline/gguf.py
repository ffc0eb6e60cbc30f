"""`quantkit export --format gguf`: a float model to one GGUF file for llama.cpp.

Load the float model, choose each tensor's block type by llama.cpp's rules for the file
type (`formats.gguf_file.tensor_type`), calibrate (method "gptq": AWQ's scales folded into
the float weights, then GPTQ rounding on the type's grid with importance-weighted block
parameters, block by block on the calibration text; "imatrix": the importance-weighted
parameter search alone, what llama-quantize does with an importance matrix; "rtn": the
search without calibration), pack and write.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from quantkit.calibration.method import Calibration
from quantkit.errors import QuantkitError
from quantkit.formats import gguf_file
from quantkit.formats.gguf import TYPES, Blocks, choose
from quantkit.formats.gguf_pack import pack
from quantkit.progress import Track, no_progress

METHODS = ("gptq", "imatrix", "rtn")


def export_gguf(
    model_name: str,
    output: Path,
    file_type: str,
    method: str = "gptq",
    calibration: Calibration | None = None,
    overwrite: bool = False,
    track: Track = no_progress,
    options=None,
    imatrix_out: Path | None = None,
) -> dict:
    """Write `output` and return {llama.cpp tensor name: block type} of what was written.
    `options` (calibration.gguf.GGUFOptions) tune the calibration; `imatrix_out` also writes
    the calibration's importance matrix in llama-imatrix's format."""
    from quantkit.models.loading import load_float_model

    if file_type not in gguf_file.FILE_TYPES:
        raise QuantkitError(f"unknown GGUF type {file_type!r}; choose one of {', '.join(gguf_file.FILE_TYPES)}.")
    if method not in METHODS:
        raise QuantkitError(f"unknown GGUF method {method!r}; choose one of {', '.join(METHODS)}.")
    output = Path(output)
    for path in (output, imatrix_out):
        if path is not None and Path(path).exists() and not overwrite:
            raise QuantkitError(f"{path} exists; pass --overwrite to replace it.")
    if imatrix_out is not None and (method == "rtn" or file_type == "f32"):
        raise QuantkitError(
            "an importance matrix comes from calibration; use --method gptq or imatrix and a quantized type."
        )
    from quantkit.calibration.gguf import GGUFOptions

    # AWQ's folding belongs to GPTQ's calibration; "imatrix" is llama.cpp's search on the float weights
    options = replace(options or GGUFOptions(), gptq=method == "gptq")
    options = replace(options, awq=options.awq and method == "gptq")
    if imatrix_out is not None and options.awq:
        raise QuantkitError(
            "an importance matrix for llama-quantize must hold the inputs of the unchanged float weights, and "
            "AWQ's folding changes them; add --no-awq (or use --method imatrix) with --imatrix-out."
        )
    model, tokenizer, folder = load_float_model(model_name, owned=True)
    model.float()
    family = gguf_file.check_family(model.config)
    metadata = gguf_file.metadata(model.config, family)
    source = _source_gguf(model_name)
    metadata.update(
        gguf_file.source_tokenizer(source)
        if source
        else gguf_file.tokenizer_metadata(folder, tokenizer, vocab_size=model.config.vocab_size)
    )
    calibrated = method != "rtn" and file_type != "f32"
    types = _type_rule(model, family, file_type, calibrated)
    results: dict[str, Blocks] = {}
    stats: dict = {}
    c = calibration or Calibration()
    if calibrated:
        _calibrate(model, tokenizer, types, results, method, c, track, options, stats)
    chosen: dict[str, str] = {}
    vocab = len(metadata["tokenizer.ggml.tokens"][1])
    tensors = _tensors(model, family, types, results, chosen, vocab)
    gguf_file.write(output, family.arch, _name(model_name), file_type, metadata, tensors)
    if imatrix_out is not None:
        named = {gguf_file.gguf_name(f"{full}.weight", family): v for full, v in stats.items()}
        gguf_file.write_imatrix(imatrix_out, family.arch, named, c.dataset, c.samples, c.seq_len)
    return chosen


def _name(model_name: str) -> str:
    return Path(str(model_name)).name or str(model_name)


def _source_gguf(model_name: str) -> Path | None:
    """The GGUF file a built-in model was converted from: its tokenizer is written back as it was."""
    from quantkit import assets
    from quantkit.models.loading import BUILTIN_MODELS

    return Path(assets.fetch(BUILTIN_MODELS[str(model_name)])) if str(model_name) in BUILTIN_MODELS else None


def _type_rule(model, family, file_type: str, imatrix: bool):
    """full HF module name -> its BlockType (None: float32)."""
    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    n_layer = config.num_hidden_layers
    modules = dict(model.named_modules())

    def types(full: str):
        name = gguf_file.gguf_name(f"{full}.weight", family)
        if name is None:
            return None
        cols = modules[full].weight.shape[1]
        chosen = gguf_file.tensor_type(file_type, name, cols, n_layer, tied, imatrix, gguf_file.experts(config))
        return None if chosen == "f32" else TYPES[chosen]

    return types


def _calibrate(model, tokenizer, types, results, method: str, c: Calibration, track: Track, options, stats) -> None:
    from quantkit.calibration.datasets import calibration_samples, load_documents
    from quantkit.calibration.gguf import gguf_step
    from quantkit.calibration.runner import run_blocks
    from quantkit.models.arch import arch_for

    spec = arch_for(model.config)
    samples = calibration_samples(tokenizer, load_documents(c.dataset, "calib"), c.samples, c.seq_len, c.seed)
    step = gguf_step(spec, types, results, options, stats)
    run_blocks(model, spec, step, samples, c.batch_size, track=track)


def _tensors(model, family, types, results: dict, chosen: dict, vocab: int):
    """(llama.cpp name, array, BlockType or None) of every tensor, in the model's order, as
    llama.cpp's converter writes them: q/k rows interleaved for the Llama RoPE, norms shifted by
    the family's offset, the token embedding cut to the tokenizer's `vocab` rows where it does."""
    config = model.config
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads or config.num_attention_heads}
    state = model.state_dict()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    factors = gguf_file.rope_factors(config)
    if factors is not None:  # Llama 3's scaled RoPE: llama.cpp divides each frequency by these
        chosen["rope_freqs.weight"] = "f32"
        yield "rope_freqs.weight", factors, None
    n_experts = gguf_file.experts(config)
    stacks: dict[str, dict[int, np.ndarray]] = {}  # an experts' tensor until all its experts are in
    for hf, weight in state.items():
        name = gguf_file.gguf_name(hf, family)
        if name is None or (tied and name == "output.weight"):
            continue
        full = hf.removesuffix(".weight")
        t = types(full) if weight.dim() == 2 else None
        short = name.split(".")[-2]
        perm = gguf_file.rope_rows(weight.shape[0], heads[short]) if family.interleave_rope and short in heads else None
        if family.trim_vocab and name == "token_embd.weight":
            weight = weight[:vocab]
        chosen[name] = "f32" if t is None else t.name
        if name.endswith("ffn_gate_inp_shexp.weight"):  # a [1, hidden] linear that llama.cpp reads as [hidden]
            weight = weight.reshape(-1)
        if t is None:
            array = weight.float() + (family.norm_shift if name.endswith("norm.weight") else 0.0)
            data = (array[perm] if perm is not None else array).numpy()
        else:
            b = results.get(full)
            if b is None:  # not calibrated (the embedding, or --method rtn): the search without importance
                b = choose(weight.float(), t)
            data = pack(b)
            data = data[perm.numpy()] if perm is not None else data
        expert = gguf_file.expert_index(hf)
        if expert is not None:
            stack = stacks.setdefault(name, {})
            stack[expert] = data
            if len(stack) < n_experts:
                continue
            stacks.pop(name)
            data = np.stack([stack[e] for e in range(n_experts)])  # [experts, rows, ...]
        yield name, data, t
