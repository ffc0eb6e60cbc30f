import json

import pytest
import torch

import quantkit.formats.checkpoint as ckpt
from quantkit.errors import QuantkitError

DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
)


def tensors():
    return {"a.weight": torch.randn(4, 8), "b.weight_packed": torch.randint(0, 100, (4, 1), dtype=torch.int32)}


def test_save_and_read_back(tmp_path):
    out = ckpt.save_checkpoint(tmp_path / "c", tensors(), {"model_type": "llama"}, {"algorithm": "rtn"})
    back = ckpt.read_tensors(out)
    assert set(back) == {"a.weight", "b.weight_packed"}
    assert json.loads((out / "config.json").read_text()) == {"model_type": "llama"}
    assert ckpt.read_provenance(out) == {"algorithm": "rtn"}
    assert [p.name for p in tmp_path.iterdir()] == ["c"]  # no temporary folder left


def test_shards_and_index(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "SHARD_BYTES", 100)
    t = {f"w{i}": torch.randn(8) for i in range(5)}  # 32 bytes each
    out = ckpt.save_checkpoint(tmp_path / "c", t, {}, {})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    back = ckpt.read_tensors(out)
    assert all(torch.equal(back[k], v) for k, v in t.items())


def test_existing_output_needs_overwrite(tmp_path):
    out = ckpt.save_checkpoint(tmp_path / "c", tensors(), {"v": 1}, {})
    with pytest.raises(QuantkitError, match="already exists; choose another -o or pass --overwrite"):
        ckpt.save_checkpoint(out, tensors(), {"v": 2}, {})
    ckpt.save_checkpoint(out, tensors(), {"v": 2}, {}, overwrite=True)
    assert json.loads((out / "config.json").read_text()) == {"v": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_failure_leaves_nothing_behind(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(ckpt.ShardWriter, "finish", boom)
    with pytest.raises(RuntimeError):
        ckpt.save_checkpoint(tmp_path / "c", tensors(), {}, {})
    assert list(tmp_path.iterdir()) == []


def test_no_disk_space(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10, 10, 1000))
    with pytest.raises(QuantkitError, match="not enough disk space"):
        ckpt.save_checkpoint(tmp_path / "c", tensors(), {}, {})
    assert list(tmp_path.iterdir()) == []


def test_truncated_file_is_reported(tmp_path):
    out = ckpt.save_checkpoint(tmp_path / "c", tensors(), {}, {})
    f = out / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(QuantkitError, match="unreadable or truncated"):
        ckpt.read_tensors(out)
    (out / "model.safetensors").unlink()
    with pytest.raises(QuantkitError, match="no .safetensors files"):
        ckpt.read_tensors(out)


def test_our_reader_equals_safetensors_for_every_dtype(tmp_path):
    from safetensors.torch import load_file, save_file

    t = {f"x.{dt}": (torch.randn(3, 5) * 100).to(dt) for dt in DTYPES}
    t.update({"scalar": torch.tensor(1.5), "empty": torch.zeros(0, 4), "flag": torch.tensor([True, False])})
    (tmp_path / "c").mkdir()
    save_file(t, tmp_path / "c" / "model.safetensors", metadata={"format": "pt"})
    ours, theirs = ckpt.read_tensors(tmp_path / "c"), load_file(tmp_path / "c" / "model.safetensors")
    assert set(ours) == set(theirs)
    for k in theirs:
        assert ours[k].dtype == theirs[k].dtype and torch.equal(
            ours[k].view(-1).view(torch.uint8), theirs[k].view(-1).view(torch.uint8)
        ), k


def mixed_tensors(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        dt = DTYPES[int(torch.randint(len(DTYPES), (1,), generator=g))]
        rows = int(torch.randint(0, 4, (1,), generator=g))
        out[f"model.layers.{int(torch.randint(0, 30, (1,), generator=g))}.t{i}"] = (
            torch.randn(rows, 3, generator=g) * 10
        ).to(dt)
    out["scalar"] = torch.tensor(2.5)
    return out


def test_shard_writer_is_byte_identical_to_save_file(tmp_path):
    # the reference: safetensors' own writer orders tensors by dtype (descending), then name
    from safetensors.torch import save_file

    t = mixed_tensors()
    save_file(t, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    (tmp_path / "w").mkdir()
    w = ckpt.ShardWriter(tmp_path / "w")
    for k, v in t.items():
        w.add(k, v)
    assert w.finish() == ["model.safetensors"]
    assert (tmp_path / "w" / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["model.safetensors"]  # data files gone


def test_shard_writer_resumes_from_its_state(tmp_path):
    t = list(mixed_tensors(30, seed=1).items())
    straight, resumed = tmp_path / "a", tmp_path / "b"
    straight.mkdir(), resumed.mkdir()
    w = ckpt.ShardWriter(straight, max_bytes=64)
    for k, v in t:
        w.add(k, v)
    names = w.finish()
    assert len(names) > 2 and names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    w = ckpt.ShardWriter(resumed, max_bytes=64)
    for k, v in t[:17]:
        w.add(k, v)
    state = json.loads(json.dumps(w.state()))  # what a crashed run left on disk
    for k, v in t[17:25]:  # written after the state was taken: dropped on resume
        w.add(k, torch.zeros_like(v))
    w._close()
    w = ckpt.ShardWriter(resumed, max_bytes=64, state=state)
    for k, v in t[17:]:
        w.add(k, v)
    assert w.finish() == names
    for name in [*names, "model.safetensors.index.json"]:
        assert (resumed / name).read_bytes() == (straight / name).read_bytes(), name
    back = ckpt.read_tensors(resumed)
    assert all(torch.equal(back[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)) for k, v in t)


def test_missing_shard_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "SHARD_BYTES", 100)
    out = ckpt.save_checkpoint(tmp_path / "c", {f"w{i}": torch.randn(8) for i in range(5)}, {}, {})
    (out / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(QuantkitError, match="model-00002-of-00002.safetensors is missing"):
        ckpt.TensorFiles(out)


@pytest.mark.parametrize(
    "text, size", [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 * 2**30), ("1000", 1000), ("1.5 kb", 1500)]
)
def test_parse_size(text, size):
    assert ckpt.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "five", "5XB", "-1GB", "0"])
def test_parse_size_refuses(text):
    with pytest.raises(QuantkitError, match="write it like 5GB"):
        ckpt.parse_size(text)
