"""The built-in lm-eval tasks made from the wiki text: deterministic, well-formed data."""

import json

import pytest
import yaml

from quantkit.calibration.datasets import load_documents
from quantkit.errors import QuantkitError
from quantkit.eval import tasks

DOCS = [
    "Heading line\nThe river runs past the old mill and then turns toward the town. It rained. "
    "Every spring the farmers plant barley in the fields near the water.",
    "Engineers measured the bridge and found that the steel had started to rust. Was it safe? "
    "The committee met on Tuesday and voted to close the road for repairs.\n"
    "Many visitors still walk along the path beside the quiet canal.",
]


def test_sentences_and_cloze_pairs():
    found = tasks.sentences(DOCS)
    assert found[:3] == [
        "Heading line",
        "The river runs past the old mill and then turns toward the town.",
        "It rained.",
    ]
    assert tasks.cloze_pair(found[1]) == ("The river runs past the old mill and then turns toward the", "town")
    assert [tasks.cloze_pair(s) for s in ("Heading line", "It rained.", "Was it safe?")] == [None] * 3
    assert tasks.cloze_pair("It was built in the year 1850 by the local council of Lyon.") is None  # capitalised


def test_cloze_items_well_formed_and_seeded():
    items = tasks.cloze_items(DOCS, n=4, seed=0)
    pairs = {c: w for s in tasks.sentences(DOCS) if (p := tasks.cloze_pair(s)) for c, w in [p]}
    assert len(items) == 4 and len({it["context"] for it in items}) == 4
    for i, item in enumerate(items):
        assert item["id"] == i and len(item["choices"]) == 4 and len(set(item["choices"])) == 4
        assert item["choices"][item["gold"]] == pairs[item["context"]]
        assert set(item["choices"]) <= set(pairs.values())
    assert tasks.cloze_items(DOCS, n=4, seed=0) == items
    assert tasks.cloze_items(DOCS, n=4, seed=1) != items
    with pytest.raises(QuantkitError, match="too few for 6 cloze items"):
        tasks.cloze_items(DOCS, n=6)


def test_distractors_come_from_the_same_document():
    words = [["apple", "pear", "plum", "grape", "melon"], ["hammer", "nail", "screw", "drill", "saw"]]
    docs = [" ".join(f"In the morning the people of the valley went out to find the {w}." for w in ws) for ws in words]
    items = tasks.cloze_items(docs, n=10, seed=3)
    assert len(items) == 10
    for item in items:
        assert any(set(item["choices"]) <= set(ws) for ws in words), item  # never mixed


def test_wiki_task_folder_is_deterministic(tmp_path):
    docs = load_documents("wiki", "eval")
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        tasks.write_task_folder(tmp_path / name, docs, final=tmp_path / "final")
    for file in ("wiki_cloze.jsonl", "wiki_wordppl.jsonl"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes()
    cloze = [json.loads(line) for line in (tmp_path / "a" / "wiki_cloze.jsonl").read_text().splitlines()]
    assert len(cloze) == tasks.CLOZE_ITEMS and {len(set(it["choices"])) for it in cloze} == {4}
    assert {it["gold"] for it in cloze} == {0, 1, 2, 3}
    assert all(it["context"] + " " + it["choices"][it["gold"]] + "." in "\n".join(docs) for it in cloze[:50])
    wordppl = (tmp_path / "a" / "wiki_wordppl.jsonl").read_text().splitlines()
    assert [json.loads(line)["text"] for line in wordppl] == docs
    config = yaml.safe_load((tmp_path / "a" / "wiki_cloze.yaml").read_text())
    assert config["task"] == "wiki_cloze" and config["dataset_path"] == "json"
    assert config["dataset_kwargs"]["data_files"]["test"] == str(tmp_path / "final" / "wiki_cloze.jsonl")


def test_task_folder_built_once_in_the_cache(monkeypatch, tmp_path):
    import quantkit.assets
    import quantkit.calibration.datasets

    docs = load_documents("wiki", "eval")
    monkeypatch.setattr(quantkit.assets, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(quantkit.calibration.datasets, "load_documents", lambda name, split: docs)
    folder = tasks.task_folder()
    assert folder == tmp_path / "eval_tasks" / f"v{tasks.VERSION}"
    assert {p.name for p in folder.iterdir()} == {f"{t}.{ext}" for t in tasks.TASKS for ext in ("yaml", "jsonl")}
    (folder / "wiki_cloze.yaml").write_text("stale")
    monkeypatch.setattr(tasks, "write_task_folder", lambda *args, **kwargs: pytest.fail("rebuilt"))
    assert tasks.task_folder() == folder  # the data is kept, the YAML rendered again
    assert yaml.safe_load((folder / "wiki_cloze.yaml").read_text())["task"] == "wiki_cloze"
