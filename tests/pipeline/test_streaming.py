"""Calibration streams the model from its files and writes the checkpoint as it goes: the
result equals the in-memory pipeline's (the reference: the whole float model loaded,
calibrated, packed), one block is in memory at a time, and a run killed at any moment
resumes to the same bytes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import make_family_model, make_tiny_model

from quantkit.calibration.kv import kv_args
from quantkit.calibration.registry import method as method_entry
from quantkit.calibration.runner import run_blocks
from quantkit.errors import QuantkitError
from quantkit.formats.checkpoint import read_tensors
from quantkit.models import kv_cache
from quantkit.models.arch import arch_for
from quantkit.models.loading import load_float_model
from quantkit.pipeline import quantize as pipeline
from quantkit.pipeline import stream
from quantkit.pipeline.quantize import Calibration, pack_model, quantize
from quantkit.scheme import preset

TESTS = Path(__file__).resolve().parents[1]


def scheme(kv: bool = False):
    s = preset("w4a16-asym").with_group_size(32)
    return s.replace(kv_cache=kv_args("int8", True)) if kv else s


def calibration(corpus) -> Calibration:
    return Calibration(str(corpus), 8, 32, 0, 4)


def in_memory_reference(model_path, s, method, corpus) -> dict:
    """What the pipeline wrote before it streamed: the float model loaded whole, calibrated
    in fp32, KV scales set after the last block, packed in the model's dtype."""
    from quantkit.calibration.datasets import calibration_samples, load_documents

    model, tokenizer, _ = load_float_model(model_path, owned=True)
    dtype, spec = model.dtype, arch_for(model.config)
    results = {}
    m = method_entry(method)
    step = m.make_step(spec, s, m.options(), results, dtype)
    c = calibration(corpus)
    samples = calibration_samples(tokenizer, load_documents(c.dataset, "calib"), c.samples, c.seq_len, c.seed)
    model.float()
    if s.kv_cache is None:
        run_blocks(model, spec, step, samples, c.batch_size)
    else:
        with kv_cache.record_kv_amax(model):
            run_blocks(model, spec, pipeline._observe_kv_after(step, spec), samples, c.batch_size)
        kv_cache.quantize_kv(model, kv_cache.calibrated_scales(model, s.kv_cache), s.kv_cache)
    return pack_model(model, s, results, dtype)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def source(path, family=None, **kwargs):
    """A tiny Llama, or a tiny model of conftest.FAMILIES."""
    return make_family_model(path, family, **kwargs) if family else make_tiny_model(path, **kwargs)


@pytest.mark.parametrize(
    "dtype, shard, method, kv, family",
    [
        (torch.float32, None, "gptq", True, None),
        (torch.bfloat16, "20KB", "awq", False, None),
        (torch.float16, "30KB", "rtn", True, None),
        (torch.float32, "40KB", "awq", False, "qwen2-moe"),  # experts, a shared expert, a dense layer
        (torch.bfloat16, None, "gptq", False, "mixtral"),
    ],
)
def test_streaming_equals_the_in_memory_pipeline(tmp_path, tiny_corpus, dtype, shard, method, kv, family):
    src = source(tmp_path / "src", family, dtype=dtype, num_hidden_layers=3)
    if shard:  # the source itself sharded
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(src, dtype=dtype).save_pretrained(src, max_shard_size=shard)
        assert (src / "model.safetensors.index.json").is_file()
    s = scheme(kv)
    quantize(str(src), s, tmp_path / "q", method, calibration(tiny_corpus), max_shard_size=shard or "5GB")
    assert same(read_tensors(tmp_path / "q"), in_memory_reference(src, s, method, tiny_corpus))
    assert (tmp_path / "q" / "model.safetensors.index.json").is_file() == bool(shard)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q", "src"]  # no partial folder left


@pytest.mark.parametrize("family", [None, "mixtral"])  # one block's experts at a time, not all of them
def test_one_block_in_memory_at_a_time(tmp_path, tiny_corpus, monkeypatch, family):
    src = source(tmp_path / "src", family, num_hidden_layers=4)
    seen, models = [], []
    opened = pipeline.open_float_model

    def spy_open(*a, **k):
        models.append(opened(*a, **k))
        return models[-1]

    def spy_step(make):
        def wrapper(*a, **k):
            inner = make(*a, **k)

            def step(index, prefix, block, inputs):
                model = models[0][0]
                real = [n for n, p in model.named_parameters() if p.device.type != "meta"]
                seen.append((index, {n.split(".")[2] if ".layers." in n else n for n in real}))
                inner(index, prefix, block, inputs)

            for attr in ("finish", "state", "restore"):
                setattr(step, attr, getattr(inner, attr))
            return step

        return wrapper

    monkeypatch.setattr(pipeline, "open_float_model", spy_open)
    monkeypatch.setattr(pipeline, "_make_step", spy_step(pipeline._make_step))
    quantize(str(src), scheme(), tmp_path / "q", "gptq", calibration(tiny_corpus))
    assert seen == [(i, {str(i)}) for i in range(4)]  # no embeddings, no other block


KILLED = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from quantkit.formats import checkpoint
from quantkit.pipeline import stream
from quantkit.pipeline.quantize import Calibration, quantize
from quantkit.calibration.kv import kv_args
from quantkit.scheme import preset

where, n = sys.argv[1], int(sys.argv[2])
import torch
torch.set_num_threads(int(sys.argv[8]))  # the test process's: GEMMs split over other threads round differently
stream.COMMIT_SECONDS = float(sys.argv[9])  # 0: after every block; inf: only after the last
calls = [0]

def killer(original):
    def call(*a, **k):
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*a, **k)
    return call

if where == "add":  # in the middle of writing a block's tensors
    checkpoint.ShardWriter.add = killer(checkpoint.ShardWriter.add)
else:  # inside a commit: inputs saved, the state not yet replaced
    stream.write_atomic = killer(stream.write_atomic)
s = preset("w4a16-asym").with_group_size(32).replace(kv_cache=kv_args("int8", True))
quantize(sys.argv[3], s, sys.argv[4], sys.argv[5], Calibration(sys.argv[6], 8, 32, 0, 4),
         options=json.loads(sys.argv[7]), max_shard_size="40KB")
"""


@pytest.mark.parametrize(
    "where, n, method, family, every",
    [
        ("add", 3, "gptq", None, 0),
        ("add", 40, "gptq", None, 0),
        ("commit", 3, "gptq", None, 0),
        ("add", 30, "awq", None, 0),
        ("commit", 4, "gptq", "qwen3-moe", 0),  # the expert token counts of the blocks done are carried
        ("add", 40, "gptq", None, math.inf),  # killed blocks after the last commit (the first one's)
        ("add", 30, "awq", None, math.inf),
        ("commit", 3, "autoround", None, 0),  # the float stream of its targets is carried
        ("commit", 3, "gptq+float", None, 0),  # GPTQ's float targets: their stream too
    ],
)
def test_killed_run_resumes_byte_identical(tmp_path, tiny_corpus, where, n, method, family, every):
    """Killed anywhere, with a commit after every block or blocks since the last one, a
    resumed run writes what an uninterrupted one does, byte for byte."""
    src = source(tmp_path / "src", family, num_hidden_layers=4)
    options = {"save_search": str(tmp_path / "search-{}.safetensors")} if method == "awq" else {}
    options = {"iters": 3, "batch": 2} if method == "autoround" else options
    if method == "gptq+float":
        method, options = "gptq", {"float_targets": True}
    s = scheme(kv=True)

    def opts(name):
        return {k: v.format(name) if isinstance(v, str) else v for k, v in options.items()}

    straight = quantize(
        str(src), s, tmp_path / "straight", method, calibration(tiny_corpus), opts("a"), max_shard_size="40KB"
    )
    assert straight["resume_state"]["commits"] >= 3  # the start, after the last block, after the tail
    script = "import json\n" + textwrap.dedent(KILLED).format(tests=str(TESTS))
    args = [where, str(n), str(src), str(tmp_path / "resumed"), method, str(tiny_corpus), json.dumps(opts("b"))]
    args += [str(torch.get_num_threads()), str(every)]
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-2000:]
    partial = tmp_path / ".resumed.partial"
    assert partial.is_dir() and not (tmp_path / "resumed").exists()
    with pytest.raises(QuantkitError, match="pass --resume to continue it or --overwrite to start over"):
        quantize(str(src), s, tmp_path / "resumed", method, calibration(tiny_corpus), opts("b"), max_shard_size="40KB")
    prov = quantize(
        str(src),
        s,
        tmp_path / "resumed",
        method,
        calibration(tiny_corpus),
        opts("b"),
        resume=True,
        max_shard_size="40KB",
    )
    assert prov["resumed_at_block"] >= 0
    assert every == 0 or prov["resumed_at_block"] == 0  # nothing committed since the start
    made = {"quantkit.json", "README.md"}  # provenance and model card: times and dates differ
    names = sorted(p.name for p in (tmp_path / "straight").iterdir() if p.name not in made)
    assert names == sorted(p.name for p in (tmp_path / "resumed").iterdir() if p.name not in made)
    assert any(n.startswith("model-00002-of-") for n in names)  # several shards
    for name in names:
        assert (tmp_path / "straight" / name).read_bytes() == (tmp_path / "resumed" / name).read_bytes(), name
    if family:
        tokens = [
            json.loads((tmp_path / x / "quantkit.json").read_text())["expert_tokens"] for x in ("straight", "resumed")
        ]
        assert tokens[0] == tokens[1] and len(tokens[0]) == 4
    if method == "awq":  # the search carried from block to block was restored
        a, b = (read_tensors_file(tmp_path / f"search-{x}.safetensors") for x in "ab")
        assert same(a, b) and len(a) > 0
    assert not partial.exists()


def read_tensors_file(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path)


def test_resume_refuses_other_calibration(tmp_path, tiny_corpus, monkeypatch):
    src = make_tiny_model(tmp_path / "src", num_hidden_layers=3)

    def die(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(stream.BlockStream, "write_tail", die)
    with pytest.raises(KeyboardInterrupt):
        quantize(str(src), scheme(), tmp_path / "q", "gptq", calibration(tiny_corpus))
    monkeypatch.undo()
    other = Calibration(str(tiny_corpus), 4, 32, 0, 4)
    with pytest.raises(QuantkitError, match=r"started with calibration\.samples = 8, not 4; rerun with its"):
        quantize(str(src), scheme(), tmp_path / "q", "gptq", other, resume=True)
    monkeypatch.setattr(stream, "_environment", lambda: {"torch": "x", "threads": 64})
    notes = []
    prov = quantize(str(src), scheme(), tmp_path / "q", "gptq", calibration(tiny_corpus), resume=True, log=notes.append)
    assert prov["resumed_at_block"] == 3  # every block was done; only the tail was left
    assert "may not be byte-identical to an uninterrupted run" in notes[0] and "'threads': 64" in notes[0]
    assert same(read_tensors(tmp_path / "q"), in_memory_reference(src, scheme(), "gptq", tiny_corpus))


def test_truncated_model_file_is_named_before_any_work(tmp_path, tiny_corpus):
    src = make_tiny_model(tmp_path / "src")
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(QuantkitError, match=r"model\.safetensors is unreadable or truncated"):
        quantize(str(src), scheme(), tmp_path / "q", "gptq", calibration(tiny_corpus))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_missing_shard_is_named_before_any_work(tmp_path, tiny_corpus):
    from transformers import AutoModelForCausalLM

    src = make_tiny_model(tmp_path / "src")
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(src, max_shard_size="40KB")
    (src / "model.safetensors").unlink(missing_ok=True)
    shard = sorted(src.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(QuantkitError, match=f"{shard.name} is missing"):
        quantize(str(src), scheme(), tmp_path / "q", "gptq", calibration(tiny_corpus))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_not_enough_disk_is_refused_before_starting(tmp_path, tiny_corpus, monkeypatch):
    import shutil
    from collections import namedtuple

    src = make_tiny_model(tmp_path / "src")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6, 1000))
    with pytest.raises(QuantkitError, match=r"not enough disk space in .*: the checkpoint needs about \d+ MiB"):
        quantize(str(src), scheme(), tmp_path / "q", "gptq", calibration(tiny_corpus))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize(
    "family, preset_name, method",
    [(None, "w4a16-asym", "gptq"), ("phi3", "w4a16", "rtn"), ("qwen2-moe", "w4a16", "rtn"), (None, "fp8", "fp8")],
)
def test_checkpoint_bytes_are_the_written_tensors(tmp_path, tiny_corpus, family, preset_name, method):
    # the formats' byte counts (formats/stored.py) against what the run wrote, tensor for tensor
    src = source(tmp_path / "src", family, num_hidden_layers=3)
    s = preset(preset_name)
    s = s.with_group_size(32) if s.weights.strategy == "group" else s
    quantize(str(src), s, tmp_path / "q", method, calibration(tiny_corpus))
    written = sum(t.numel() * t.element_size() for t in read_tensors(tmp_path / "q").values())
    model, *_ = pipeline.open_float_model(src)
    spec = arch_for(model.config)
    s = pipeline._fit_groups(model, spec, s, None)
    schemes = pipeline.linear_schemes(model, spec, s)
    assert pipeline.checkpoint_bytes(model, schemes, torch.float32) == written


def test_cli_resume_and_shard_size(tmp_path):
    from typer.testing import CliRunner

    from quantkit.cli import app

    runner = CliRunner()
    src = make_tiny_model(tmp_path / "src")
    cmd = ["rtn", "-m", str(src), "-o", str(tmp_path / "q"), "--group-size", "32"]
    (tmp_path / ".q.partial").mkdir()
    r = runner.invoke(app, cmd)
    assert r.exit_code == 2 and "pass --resume to continue it or --overwrite to start over" in " ".join(
        r.output.split()
    )
    r = runner.invoke(app, [*cmd, "--resume", "--max-shard-size", "40KB"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "q" / "model.safetensors.index.json").is_file()
    r = runner.invoke(app, [*cmd, "--max-shard-size", "5 parsecs", "--overwrite"])
    assert r.exit_code == 2 and "max_shard_size: '5 parsecs' is not allowed" in " ".join(r.output.split())


def test_names_transformers_translates_load_the_model_whole(tmp_path):
    # a checkpoint saved without the "model." prefix: transformers maps it, so calibration
    # reads it through a loaded model (and says so) and writes the same checkpoint
    from safetensors.torch import load_file, save_file

    a = make_tiny_model(tmp_path / "a", tie=True)
    b = make_tiny_model(tmp_path / "b", tie=True)
    t = load_file(b / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in t.items()}, b / "model.safetensors", metadata={"format": "pt"})
    notes = []
    quantize(str(a), scheme(), tmp_path / "qa", "rtn")
    quantize(str(b), scheme(), tmp_path / "qb", "rtn", log=notes.append)
    assert same(read_tensors(tmp_path / "qa"), read_tensors(tmp_path / "qb"))
    assert notes == [f"the tensor names in {b} are not the model's own; loading the whole model to translate them"]
