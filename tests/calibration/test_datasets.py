import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import quantkit.hub
from quantkit.calibration.datasets import calibration_samples, eval_tokens, load_documents
from quantkit.errors import QuantkitError

DOCS = [
    f"Document number {i} talks about {w} and nothing else."
    for i, w in enumerate(["apples", "rivers", "engines", "music", "stones", "clouds", "bridges", "owls"])
]


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tok.train_from_iterator(DOCS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", model_max_length=16)


def test_news_documents():
    docs = load_documents("news")
    assert len(docs) == 3788
    assert all(d and '"?' not in d for d in docs)
    text = "\n".join(docs)
    assert 'The Senate voted on DeVos" highly contentious nomination' in text
    assert "WASHINGTON — House Speaker Paul Ryan" in text
    assert 'a hearing," Peterson said.' in text
    assert load_documents("news", "eval") == docs


def test_wiki_documents():
    docs = load_documents("wiki")
    assert 95 <= len(docs) <= 115
    assert 2_000_000 < sum(map(len, docs)) < 4_000_000
    text = "\n".join(docs)
    for markup in ("{{", "}}", "[[", "]]", "<ref", "'''", "{|", "==", "&nbsp;", "<!--", "\n\n\n"):
        assert markup not in text, markup
    assert docs[0].startswith(
        "Anarchism is a political philosophy that advocates self-governed "
        "societies based on voluntary institutions. These are often described "
        "as stateless societies, although"
    )
    assert all(line == line.strip() for d in docs for line in d.split("\n"))
    assert load_documents("wiki", "eval") == docs


def test_local_files_round_trip(tmp_path):
    txt = tmp_path / "docs.txt"
    txt.write_text("first doc\nstill first\n\n\nsecond doc\n  \nthird doc\n")
    assert load_documents(str(txt)) == ["first doc\nstill first", "second doc", "third doc"]

    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(DOCS[:3])) + "\n\n")
    assert load_documents(str(jsonl), "eval") == DOCS[:3]

    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": DOCS[:4] + [""], "n": list(range(5))}), parquet)
    assert load_documents(str(parquet)) == DOCS[:4]


def test_load_errors(tmp_path, monkeypatch):
    with pytest.raises(QuantkitError, match="does not exist"):
        load_documents(str(tmp_path / "missing.txt"))
    with pytest.raises(QuantkitError, match="unknown dataset 'nope'; use news, wiki"):
        load_documents("nope")
    csv_file = tmp_path / "docs.csv"
    csv_file.write_text("text\nhello\n")
    with pytest.raises(QuantkitError, match=r"\.txt, \.jsonl or \.parquet"):
        load_documents(str(csv_file))
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text(json.dumps({"body": "hello"}) + "\n")
    with pytest.raises(QuantkitError, match="no 'text' field"):
        load_documents(str(jsonl))
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"body": ["hello"]}), parquet)
    with pytest.raises(QuantkitError, match="no 'text' column"):
        load_documents(str(parquet))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n\n")
    with pytest.raises(QuantkitError, match="no documents"):
        load_documents(str(empty))
    monkeypatch.setattr(quantkit.hub, "hub_reachable", lambda: False)
    for name in ("c4", "wikitext2", "pileval"):
        with pytest.raises(QuantkitError, match="news") as err:
            load_documents(name)
        assert "cannot be reached" in str(err.value)


def test_calibration_samples(tokenizer):
    rows = calibration_samples(tokenizer, DOCS, n_samples=4, seq_len=10, seed=0)
    assert rows.shape == (4, 10) and rows.dtype == torch.long
    assert torch.equal(rows, calibration_samples(tokenizer, DOCS, 4, 10, seed=0))
    assert not torch.equal(rows, calibration_samples(tokenizer, DOCS, 4, 10, seed=1))

    order = list(range(len(DOCS)))
    random.Random(0).shuffle(order)  # the documented method: shuffled documents joined by "\n\n"
    stream = tokenizer("\n\n".join(DOCS[i] for i in order), add_special_tokens=False)["input_ids"]
    assert rows.flatten().tolist() == stream[:40]


def test_calibration_samples_errors(tokenizer):
    available = len(eval_tokens(tokenizer, DOCS))
    with pytest.raises(QuantkitError, match=f"only {available} tokens .* need 1000; use fewer --samples"):
        calibration_samples(tokenizer, DOCS, n_samples=10, seq_len=100)
    with pytest.raises(QuantkitError, match="positive"):
        calibration_samples(tokenizer, DOCS, n_samples=0, seq_len=8)
    with pytest.raises(QuantkitError, match="positive"):
        calibration_samples(tokenizer, DOCS, n_samples=2, seq_len=-1)


def test_eval_tokens(tokenizer):
    ids = eval_tokens(tokenizer, DOCS)
    assert ids.dim() == 1 and ids.dtype == torch.long
    assert len(ids) > tokenizer.model_max_length
    assert tokenizer.decode(ids) == "\n\n".join(DOCS)
