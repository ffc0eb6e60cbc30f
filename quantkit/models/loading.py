"""Find a model (built-in name, local folder or hub id) and load it in float."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from quantkit import assets
from quantkit.errors import QuantkitError
from quantkit.hub import hub_reachable

# built-in name -> the GGUF asset it is converted from
BUILTIN_MODELS = {"smollm2-135m": "smollm2-135m.gguf", "gemma3-270m": "gemma3-270m.gguf"}


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """A local folder holding the model's config.json and weights."""
    name = str(name_or_path)
    if name in BUILTIN_MODELS:
        return _builtin(name)
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise QuantkitError(
                f"{path} has no config.json; point at a Hugging Face model folder "
                f"or use a built-in model ({', '.join(BUILTIN_MODELS)})."
            )
        return path
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise QuantkitError(
            f"model folder {name} does not exist; check the path or use a built-in model ({', '.join(BUILTIN_MODELS)})."
        )
    return _from_hub(name)


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except Exception:
        pass
    if not hub_reachable():
        raise QuantkitError(
            f"model {repo_id!r} is neither a local folder nor reachable on the Hugging Face hub "
            f"(offline); use a local folder or a built-in model ({', '.join(BUILTIN_MODELS)})."
        )
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:
        raise QuantkitError(
            f"could not download {repo_id!r} from the Hugging Face hub ({type(e).__name__}); "
            "check the model id and your access to it."
        ) from None


def _builtin(name: str) -> Path:
    dest = assets.cache_dir() / "models" / name
    if (dest / "config.json").is_file():
        return dest
    gguf = assets.fetch(BUILTIN_MODELS[name])
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        convert_gguf(gguf, Path(tmp) / "model")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(Path(tmp) / "model", dest)
    return dest


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF file into a plain fp32 Hugging Face folder (config, safetensors, tokenizer).

    A model loaded from GGUF carries a gguf `quantization_config` and cannot be saved as
    is: rebuild it from the bare config and the loaded state dict.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    config.quantization_config = None
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def read_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise QuantkitError(f"{path / 'config.json'} is unreadable ({e}); re-create the model folder.") from None


def check_causal_lm(path: Path):
    """The transformers config of `path`, or a `QuantkitError` if it is not a causal LM."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:
        raise QuantkitError(f"{path} does not hold a model transformers knows ({type(e).__name__}: {e}).") from None
    heads = getattr(config, "architectures", None) or []
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or (
        heads and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in heads)
    ):
        raise QuantkitError(f"{path} holds a {config.model_type!r} model, which is not a causal language model.")
    return config


def load_float_model(name_or_path, dtype: torch.dtype | None = None, owned: bool = False):
    """(model, tokenizer, path) of an unquantized model, in eval mode on the CPU.

    With `owned`, the weights are read into the process's own memory instead of staying
    views of the memory-mapped safetensors files (whose pages would otherwise stay
    resident next to the calibrated copies and double the peak).
    """
    from transformers import AutoModelForCausalLM

    path = resolve_model(name_or_path)
    config = check_causal_lm(path)
    if getattr(config, "quantization_config", None) is not None:
        raise QuantkitError(f"{path} is already quantized; start from the float model.")
    model = _load_owned(path, config, dtype) if owned else None
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto")
        if owned:  # names transformers had to translate: copy what it mapped, one tensor at a time
            for p in model.parameters():
                p.data = p.data.clone()
        split_experts(model)
    model.eval()
    return model, load_tokenizer(path), path


@contextlib.contextmanager
def params_on_meta():
    """Create modules with parameters on the meta device (buffers stay real, so
    computed buffers such as rotary frequencies are correct)."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        if param is not None:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def empty_model(config, dtype: torch.dtype | str | None = None):
    """(model, dtype): the model built with parameters on the meta device, in `dtype`
    (default: the config's, else fp32), ready for `assign_weights`."""
    from transformers import AutoModelForCausalLM

    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    split_experts(model)
    return model, dtype


def split_experts(model) -> None:
    """One nn.Linear per expert, under the checkpoint's names, in a mixture-of-experts model
    (`models/moe.py`); other models are left as they are."""
    from quantkit.models import moe
    from quantkit.models.arch import ARCHS

    spec = ARCHS.get(getattr(model.config, "model_type", None))
    if spec is not None and spec.moe is not None:
        moe.install(model, spec)


def missing_and_unexpected(model, tensors) -> tuple[set, set]:
    """The model's state keys the tensors (a dict, or any container of names) lack (a tied
    lm_head needs none) and the tensor names it has no place for."""
    expected = set(model.state_dict())
    missing = expected - set(tensors)
    if getattr(model.config, "tie_word_embeddings", False):
        missing.discard("lm_head.weight")
    return missing, set(tensors) - expected


def assign_weights(model, tensors: dict) -> None:
    """Make the tensors the model's parameters and buffers (no copy), tying lm_head when the config says so."""
    model.load_state_dict(tensors, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.lm_head.weight = model.get_input_embeddings().weight


def _load_owned(path: Path, config, dtype: torch.dtype | None):
    """The model built empty and filled with tensors read (not mapped) from its files; None
    when the files' names are not the model's own (transformers then translates them)."""
    from quantkit.formats.checkpoint import read_tensors

    model, dtype = empty_model(config, dtype)
    tensors = read_tensors(path)
    if any(missing_and_unexpected(model, tensors)):
        return None
    for key in list(tensors):  # converted one at a time: never two copies of the weights
        if tensors[key].is_floating_point():
            tensors[key] = tensors[key].to(dtype)
    assign_weights(model, tensors)
    return model


class _LoadedTensors:
    """A loaded model's own tensors, served like `TensorFiles` (names transformers translated)."""

    def __init__(self, model):
        self.tensors = model.state_dict()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    def read(self, names) -> dict[str, torch.Tensor]:
        return {n: self.tensors.pop(n) for n in names}


def open_float_model(name_or_path, log=None):
    """(model, tokenizer, path, weights, dtype) of an unquantized model for calibrating it
    block by block: the model is built with its parameters on the meta device (buffers
    real, in fp32) and `load_weights` fills one module at a time from `weights`, the
    checkpoint's files (checked now, so a missing or truncated file is named before any
    work). `dtype` is the model's own (the config's). When the files' tensor names are
    not the model's (transformers translates them), the whole model is loaded instead and
    `weights` serves its tensors from memory."""
    from quantkit.formats.checkpoint import TensorFiles

    path = resolve_model(name_or_path)
    config = check_causal_lm(path)
    if getattr(config, "quantization_config", None) is not None:
        raise QuantkitError(f"{path} is already quantized; start from the float model.")
    files = TensorFiles(path)
    model, dtype = empty_model(config)
    if any(missing_and_unexpected(model, files)):
        if log:
            log(f"the tensor names in {path} are not the model's own; loading the whole model to translate them")
        loaded, _, _ = load_float_model(path)
        files = _LoadedTensors(loaded)  # its tensors carry the model's own names; the empty model stays
        del loaded
    model.eval().float()  # calibration computes in fp32 (parameters still on meta stay there)
    return model, load_tokenizer(path), path, files, dtype


def load_weights(module: nn.Module, prefix: str, weights, dtype: torch.dtype) -> None:
    """Fill `module`'s parameters and persistent buffers from the tensors `PREFIX.NAME` of
    `weights`, rounded to the model's `dtype` and then held in fp32 (what loading the model
    in its dtype and calling .float() gives). What `weights` lacks keeps its value."""
    names = {k: f"{prefix}.{k}" if prefix else k for k in module.state_dict()}
    read = weights.read([full for full in names.values() if full in weights])
    tensors = {}
    for k, full in names.items():
        if full in read:
            t = read.pop(full)
            tensors[k] = t.to(dtype).float() if t.is_floating_point() else t
    module.load_state_dict(tensors, strict=False, assign=True)


def release_weights(module: nn.Module) -> None:
    """Drop `module`'s parameters and persistent buffers (back to the meta device) once they are
    no longer needed. Non-persistent buffers stay: they are computed when the model is built
    (RoPE's inverse frequencies, Gemma's embedding scale), no file holds them for `load_weights`
    to read back, and they are small."""
    persistent = set(module.state_dict())
    kept = {n: b for n, b in module.named_buffers() if n not in persistent}
    module.to("meta")
    for name, b in kept.items():
        owner, _, leaf = name.rpartition(".")
        module.get_submodule(owner).register_buffer(leaf, b, persistent=False)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise QuantkitError(f"{path} has no usable tokenizer ({type(e).__name__}); add the tokenizer files.") from None
