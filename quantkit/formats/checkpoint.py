"""Checkpoint folders: config.json (+ quantization_config), safetensors shards,
tokenizer files and `quantkit.json` provenance. Writing is atomic: everything goes
to a hidden temporary folder beside the target, renamed into place when complete."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from pathlib import Path

import torch

from quantkit.errors import QuantkitError
from quantkit.formats.card import write_card

SHARD_BYTES = 5 * 10**9  # --max-shard-size's default, 5GB as transformers counts it
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


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes of a size such as 5GB, 500MB, 2GiB or 1000000 (as --max-shard-size takes it)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", str(text), re.IGNORECASE)
    if not m or float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()] < 1:
        raise QuantkitError(f"size {text!r} is not a size; write it like 5GB, 500MB or 2GiB.")
    return int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()])


# safetensors' dtype order (its Rust enum): a file lists tensors by dtype, descending, then
# by name, so the widest dtypes come first and every tensor stays aligned.
_ST_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64")


class ShardWriter:
    """Safetensors shards written one tensor at a time, so a checkpoint never has to be
    in memory at once. A tensor's bytes are appended to the current shard's `data-K.bin`
    as it comes; a shard is full when the next tensor would take it past `max_bytes`.
    `finish()` turns each data file into its safetensors file (header first, then the
    data in the order `safetensors.save_file` uses, so one shard is byte-identical to
    save_file's) and writes `model.safetensors.index.json` when there are several.

    `state()` (flushed and fsynced) is enough to reopen the writer after a crash: a
    writer built with it drops whatever was appended after that state was taken."""

    def __init__(self, folder: Path, max_bytes: int = SHARD_BYTES, state: dict | None = None):
        self.folder, self.max_bytes = Path(folder), max_bytes
        self.entries: list[list] = []  # [name, dtype, shape, shard (1-based), begin, end]
        self.sizes = [0]  # bytes appended to each shard's data file
        self._file = None
        if state is not None:
            self.entries, self.sizes = [list(e) for e in state["entries"]], list(state["sizes"])
            for k, size in enumerate(self.sizes, 1):
                if self._data(k).exists():
                    with open(self._data(k), "r+b") as f:
                        f.truncate(size)
        for stale in self.folder.glob("data-*.bin"):
            if int(stale.stem.split("-")[1]) > len(self.sizes):
                stale.unlink()

    def _data(self, k: int) -> Path:
        return self.folder / f"data-{k:05d}.bin"

    def add(self, name: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.sizes[-1] and self.sizes[-1] + n > self.max_bytes:
            self._close()
            self.sizes.append(0)
        if self._file is None:
            self._file = open(self._data(len(self.sizes)), "ab")
        shape, begin = list(t.shape), self.sizes[-1]
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        self._file.write(memoryview(flat.view(torch.uint8).numpy()))
        self.entries.append([name, _DTYPE_NAMES[t.dtype], shape, len(self.sizes), begin, begin + n])
        self.sizes[-1] += n

    def _close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def state(self) -> dict:
        self._close()
        return {"entries": [list(e) for e in self.entries], "sizes": list(self.sizes)}

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    def file_names(self) -> list[str]:
        n = len(self.sizes)
        return ["model.safetensors"] if n == 1 else [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]

    def finish(self) -> list[str]:
        """Write the safetensors files (and the index); returns their names. Safe to call
        again after a crash inside it: finished files are kept."""
        self._close()
        names = self.file_names()
        for k, name in enumerate(names, 1):
            if (self.folder / name).exists() and not self._data(k).exists():
                continue
            part = self.folder / (name + ".tmp")
            with open(part, "wb") as f:
                self._write_shard(k, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(part, self.folder / name)
            self._data(k).unlink(missing_ok=True)
        if len(names) > 1:
            weight_map = {e[0]: names[e[3] - 1] for e in self.entries}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return names

    def _write_shard(self, k: int, f) -> None:
        entries = sorted((e for e in self.entries if e[3] == k), key=lambda e: (-_ST_ORDER.index(e[1]), e[0]))
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, dtype, shape, _, begin, end in entries:
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + end - begin]}
            offset += end - begin
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % 8)
        f.write(len(text).to_bytes(8, "little") + text)
        with open(self._data(k), "rb") if entries else contextlib.nullcontext() as data:
            for *_, begin, end in entries:
                data.seek(begin)
                while begin < end:
                    chunk = data.read(min(end - begin, 64 << 20))
                    f.write(chunk)
                    begin += len(chunk)


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
    check_disk(out, _nbytes(tensors) + (16 << 20))
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        writer = ShardWriter(tmp, SHARD_BYTES)
        for name, t in tensors.items():
            writer.add(name, t)
        writer.finish()
        complete(tmp, out, config, provenance, source)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_disk(out: Path, need: int) -> None:
    """Refuse to start writing `need` bytes beside `out` when the disk has less free."""
    free = shutil.disk_usage(out.parent).free
    if free < need:
        raise QuantkitError(
            f"not enough disk space in {out.parent}: the checkpoint needs about "
            f"{need / 2**20:.0f} MiB and {free / 2**20:.0f} MiB are free."
        )


def complete(tmp: Path, out: Path, config: dict, provenance: dict, source: Path | None) -> None:
    """Add config.json, quantkit.json, the model card (README.md) and the tokenizer files to
    the written shards in `tmp`, then rename it into place as `out` (replacing an existing folder)."""
    try:
        for f in tmp.glob("*.safetensors"):  # a checkpoint is meant to be shared
            f.chmod(0o644)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / "quantkit.json").write_text(json.dumps(provenance, indent=2) + "\n")
        write_card(tmp, config, provenance, out.name)
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
        if e.errno == errno.ENOSPC:
            raise QuantkitError(f"the disk under {out.parent} filled up while writing; free space and retry.") from None
        raise


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    return sorted(folder.glob("*.safetensors"))


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
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class TensorFiles:
    """Where each tensor of a checkpoint folder lies, read one tensor (or one block) at a
    time. Every file's header is read and checked when this is built, so a missing shard
    or a truncated file is named before any work starts.

    The format: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape,
    data_offsets: [begin, end]}} (offsets into the data that follows), then the data.
    Tensors are read into the process's own memory, not memory-mapped: a mapping's pages
    would stay resident next to whatever the caller makes of them."""

    def __init__(self, folder: Path):
        folder = Path(folder)
        self.where: dict[str, tuple[Path, int, dict]] = {}  # name -> (file, data start, header entry)
        index = folder / "model.safetensors.index.json"
        files = weight_files(folder)
        if not files:
            raise QuantkitError(f"{folder} has no .safetensors files; it is not a complete checkpoint.")
        for f in files:
            if not f.is_file():
                raise QuantkitError(f"{f} is missing ({index.name} lists it); re-create or re-download the model.")
            try:
                self._index(f)
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise QuantkitError(
                    f"{f} is unreadable or truncated ({e}); re-create or re-download the checkpoint."
                ) from None

    def _index(self, path: Path) -> None:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            size = os.fstat(f.fileno()).st_size - 8 - n
            if size < 0:
                raise ValueError("the header runs past the end of the file")
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            if not 0 <= begin <= end <= size:
                raise ValueError(f"tensor {name} lies beyond the end of the file")
            if info["dtype"] not in _DTYPES:
                raise ValueError(f"tensor {name} has dtype {info['dtype']}, which quantkit does not read")
            self.where[name] = (path, 8 + n, info)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def __iter__(self):
        return iter(self.where)

    def read(self, names) -> dict[str, torch.Tensor]:
        """The named tensors, each file opened once."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.where[name][0], []).append(name)
        tensors = {}
        for path, group in by_file.items():
            try:
                with open(path, "rb") as f:
                    for name in group:
                        _, start, info = self.where[name]
                        begin, end = info["data_offsets"]
                        data = torch.empty(end - begin, dtype=torch.uint8)
                        f.seek(start + begin)
                        if f.readinto(memoryview(data.numpy())) != end - begin:
                            raise ValueError(f"tensor {name} is cut short")
                        tensors[name] = data.view(_DTYPES[info["dtype"]]).reshape(info["shape"])
            except (OSError, ValueError) as e:
                raise QuantkitError(
                    f"{path} is unreadable or truncated ({e}); re-create or re-download the checkpoint."
                ) from None
        return {name: tensors[name] for name in names}


def write_in_place(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Overwrite the named tensors of a checkpoint folder in its safetensors files, each cast
    to its stored dtype; the shape must be the stored one. Files and headers stay as they are."""
    files = TensorFiles(folder)
    by_file: dict[Path, list[str]] = {}
    for name in tensors:
        by_file.setdefault(files.where[name][0], []).append(name)
    for path, names in by_file.items():
        with open(path, "r+b") as f:
            for name in names:
                _, start, info = files.where[name]
                t = tensors[name].detach().to("cpu", _DTYPES[info["dtype"]]).contiguous()
                if list(t.shape) != info["shape"]:
                    raise ValueError(f"{name}: shape {list(t.shape)}, stored {info['shape']}")
                f.seek(start + info["data_offsets"][0])
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            f.flush()
            os.fsync(f.fileno())


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder, or a `QuantkitError` if a file is unreadable."""
    files = TensorFiles(folder)
    return files.read(list(files))


def read_provenance(folder: Path) -> dict | None:
    path = Path(folder) / "quantkit.json"
    return json.loads(path.read_text()) if path.is_file() else None
