"""`--tune-scales`: the int weight scales trained end to end on the KL to the float model
(`calibration.tune`); codes and zero points stay, the checkpoint loads as before."""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import FAMILIES, make_tiny_model

import quantkit
from quantkit.calibration import tune
from quantkit.calibration.datasets import Calibration, calibration_samples, load_documents
from quantkit.errors import QuantkitError
from quantkit.formats.checkpoint import read_tensors, write_in_place
from quantkit.models.loading import load_float_model, load_tokenizer
from quantkit.scheme import preset

IDS = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(0))


def _model(tmp_path, family, tie=None):
    model_type, overrides = FAMILIES[family] if family != "llama" else ("llama", {})
    tie = model_type.startswith("gemma") if tie is None else tie
    return make_tiny_model(tmp_path / "m", model_type, tie=tie, **overrides)


def _student(path, ckpt):
    teacher = load_float_model(str(path), torch.float32)[0]
    tensors = read_tensors(ckpt)
    args = {k[: -len(".weight_packed")]: preset("w4a16").weights for k in tensors if k.endswith(".weight_packed")}
    return teacher, *tune.quantized_student(teacher, tensors, args)


def _rows(path, corpus):
    return calibration_samples(load_tokenizer(path), load_documents(str(corpus), "calib"), 4, 32, 0)


@pytest.mark.parametrize(
    "family, tie, method, scheme, options, linears",
    [
        ("gemma3", True, "awq", "w4a16-asym", {}, 14),  # AWQ's scales folded into the norms: read from the checkpoint
        ("gemma3", True, "gptq", "w4a16", {"actorder": "group"}, 14),  # act-order's g_idx
        ("llama", True, "rtn", "w4a16", {"rotate": "hadamard"}, 14),  # a tied head written untied and rotated
        ("mixtral", False, "rtn", "w4a16", {}, 32),  # the experts' linears, split as the checkpoint names them
    ],
)
def test_the_untrained_student_is_the_checkpoint(tmp_path, tiny_corpus, family, tie, method, scheme, options, linears):
    path = _model(tmp_path, family, tie)
    calib = Calibration(str(tiny_corpus), 4, 32)
    quantkit.quantize(str(path), tmp_path / "q", method, scheme, group_size=32, calibration=calib, **options)
    _, student, found = _student(path, tmp_path / "q")
    assert len(found) == linears
    with torch.no_grad():
        torch.testing.assert_close(student(IDS).logits, quantkit.load(tmp_path / "q")(IDS).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_the_chunked_gradient_equals_autograd_of_the_whole_loss(tmp_path, tiny_corpus, family, monkeypatch):
    path = _model(tmp_path, family)
    quantkit.quantize(str(path), tmp_path / "q", "rtn", "w4a16-asym", group_size=32)
    teacher, student, linears = _student(path, tmp_path / "q")
    with torch.no_grad():  # away from m = 0, so every scale has a gradient of its own
        for lin in linears.values():
            lin.log_gain.normal_(0, 0.05)
    ids = _rows(path, tiny_corpus)[:1]
    params = [lin.log_gain.requires_grad_(True) for lin in linears.values()]
    monkeypatch.setattr(tune, "CHUNK", 7)  # 32 positions in 5 chunks, the last short
    # the reference: the models' own logits (transformers applies Gemma 2's soft-cap), whole
    with torch.no_grad():
        log_p = F.log_softmax(teacher(ids).logits.float(), -1)
    log_q = F.log_softmax(student(ids).logits.float(), -1)
    want_loss = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    want = torch.autograd.grad(want_loss, params)
    loss = tune.row_kl(teacher, student, ids, backward=True)
    assert loss == pytest.approx(want_loss.item(), rel=1e-5)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=1e-7)


def test_tuning_lowers_the_kl_and_keeps_codes_and_zero_points(tmp_path, tiny_corpus):
    path = _model(tmp_path, "llama")
    calib = Calibration(str(tiny_corpus), 4, 32)
    args = dict(calibration=calib, group_size=32)
    quantkit.quantize(str(path), tmp_path / "q0", "rtn", "w4a16-asym", **args)
    prov = quantkit.quantize(str(path), tmp_path / "q1", "rtn", "w4a16-asym", tune_scales=4, **args)
    before, after = read_tensors(tmp_path / "q0"), read_tensors(tmp_path / "q1")
    assert before.keys() == after.keys()
    for k in before:
        if k.endswith("weight_scale"):
            assert not torch.equal(before[k], after[k])
            ratio = after[k] / before[k]
            assert 0.8 < ratio.min() and ratio.max() < 1.25  # small steps on log s
        else:
            assert torch.equal(before[k], after[k]), k  # codes, zero points, norms, embeddings
    rows = _rows(path, tiny_corpus)

    def kl(ckpt):
        teacher, student, _ = _student(path, ckpt)
        with torch.no_grad():
            return sum(tune.row_kl(teacher, student, rows[i : i + 1], backward=False) for i in range(len(rows)))

    assert kl(tmp_path / "q1") < 0.9 * kl(tmp_path / "q0")
    record = json.loads((tmp_path / "q1" / "quantkit.json").read_text())["tune_scales"]
    assert record == prov["tune_scales"] and record["kl_last_epoch"] < record["kl_first_epoch"]
    assert not list(tmp_path.glob(".q1.partial"))


def test_a_resumed_run_writes_the_saved_scales_again(tmp_path, tiny_corpus, monkeypatch):
    # killed while the tuned scales were written into the shards: the rerun takes them from
    # the run's folder, not from a second training on half-written scales
    path = _model(tmp_path, "llama")
    args = dict(calibration=Calibration(str(tiny_corpus), 4, 32), group_size=32, tune_scales=2)
    quantkit.quantize(str(path), tmp_path / "a", "rtn", "w4a16", **args)
    from quantkit.pipeline import quantize as pipeline

    def killed(folder, tensors):
        write_in_place(folder, dict(list(tensors.items())[:3]))
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "write_in_place", killed)
    with pytest.raises(KeyboardInterrupt):
        quantkit.quantize(str(path), tmp_path / "b", "rtn", "w4a16", **args)
    monkeypatch.undo()
    monkeypatch.setattr(tune, "tune_scales", lambda *a, **k: pytest.fail("trained again"))
    quantkit.quantize(str(path), tmp_path / "b", "rtn", "w4a16", resume=True, **args)
    a, b = read_tensors(tmp_path / "a"), read_tensors(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_write_in_place_changes_only_the_named_tensors(tmp_path):
    from safetensors.torch import save_file

    save_file(
        {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}, tmp_path / "model.safetensors"
    )
    write_in_place(tmp_path, {"b": torch.tensor([1.0, 2.0, 3.0, 4.0])})
    t = read_tensors(tmp_path)
    assert torch.equal(t["a"], torch.arange(6.0).view(2, 3))
    assert t["b"].dtype == torch.bfloat16 and t["b"].tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("method, scheme", [("fp8", "fp8-dynamic"), ("rtn", "nvfp4a16"), ("rtn", "w4afp8")])
def test_schemes_without_int_weight_scales_are_refused(tmp_path, tiny_llama, method, scheme):
    with pytest.raises(QuantkitError, match="--tune-scales trains the int weight scales"):
        quantkit.quantize(str(tiny_llama), tmp_path / "q", method, scheme, tune_scales=1)
    assert not list(tmp_path.iterdir())


def test_a_model_too_large_for_the_memory_is_refused_before_any_work(tmp_path, tiny_llama, monkeypatch):
    assert tune.available_memory() > 1 << 20  # Linux's MemAvailable is read
    monkeypatch.setattr(tune, "available_memory", lambda: 1 << 20)  # the tiny model needs ~1.3 MiB
    with pytest.raises(QuantkitError, match="GiB is available; drop --tune-scales or free memory"):
        quantkit.quantize(str(tiny_llama), tmp_path / "q", "rtn", "w4a16", tune_scales=1)
    assert not list(tmp_path.iterdir())
