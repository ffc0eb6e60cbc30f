"""Checkpoint folders: config.json (+ quantization_config), safetensors shards,
tokenizer files and `quantkit.json` provenance. Writing is atomic: everything goes
to a hidden temporary folder beside the target, renamed into place when complete."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from quantkit.errors import QuantkitError

SHARD_BYTES = 4 << 30
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse an existing output folder unless `overwrite`; call before any long work."""
    if out.exists() and not overwrite:
        raise QuantkitError(f"output folder {out} already exists; choose another -o or pass --overwrite.")
    if out.exists() and not out.is_dir():
        raise QuantkitError(f"output path {out} is a file; choose a folder path for -o.")


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _shards(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    shards, size = [{}], 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if size + n > SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += n
    return shards


def _write_weights(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    shards = _shards(tensors)
    if len(shards) == 1:
        save_file(shards[0], folder / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_size": _nbytes(tensors)}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def save_checkpoint(
    out: Path,
    tensors: dict[str, torch.Tensor],
    config: dict,
    provenance: dict,
    source: Path | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a checkpoint folder atomically; tokenizer files are copied from `source`."""
    out = Path(out)
    check_output(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    need = _nbytes(tensors) + (16 << 20)
    free = shutil.disk_usage(out.parent).free
    if free < need:
        raise QuantkitError(
            f"not enough disk space in {out.parent}: the checkpoint needs "
            f"{need / 2**20:.0f} MiB and {free / 2**20:.0f} MiB are free."
        )
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        _write_weights(tmp, tensors)
        for f in tmp.iterdir():  # safetensors writes 0600; a checkpoint is meant to be shared
            f.chmod(0o644)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / "quantkit.json").write_text(json.dumps(provenance, indent=2) + "\n")
        for name in TOKENIZER_FILES if source else ():
            if (Path(source) / name).is_file():
                shutil.copy2(Path(source) / name, tmp / name)
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno == errno.ENOSPC:
            raise QuantkitError(f"the disk under {out.parent} filled up while writing; free space and retry.") from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    return sorted(folder.glob("*.safetensors"))


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder, or a `QuantkitError` if a file is unreadable.

    The tensors are read into the process's own memory, not memory-mapped: a mapping's
    pages would stay resident next to whatever the caller makes of the tensors.
    """
    files = weight_files(folder)
    if not files:
        raise QuantkitError(f"{folder} has no .safetensors files; it is not a complete checkpoint.")
    tensors = {}
    for f in files:
        try:
            tensors.update(_read_safetensors(f))
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            raise QuantkitError(
                f"{f} is unreadable or truncated ({e}); re-create or re-download the checkpoint."
            ) from None
    return tensors


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    # the format: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape,
    # data_offsets: [begin, end]}} (offsets into the data that follows), then the data
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        size = os.fstat(f.fileno()).st_size - 8 - n
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            if not 0 <= begin <= end <= size:
                raise ValueError(f"tensor {name} lies beyond the end of the file")
            data = torch.empty(end - begin, dtype=torch.uint8)
            f.seek(8 + n + begin)
            if f.readinto(memoryview(data.numpy())) != end - begin:
                raise ValueError(f"tensor {name} is cut short")
            tensors[name] = data.view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    return tensors


def read_provenance(folder: Path) -> dict | None:
    path = Path(folder) / "quantkit.json"
    return json.loads(path.read_text()) if path.is_file() else None
