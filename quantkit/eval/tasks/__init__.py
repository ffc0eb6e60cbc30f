"""Built-in lm-eval tasks made from the built-in `wiki` text, so `quantkit eval --tasks`
works with no hub:

- `wiki_cloze` (multiple choice, acc and acc_norm): a sentence without its last word;
  the choices are that word and three distractors, the last words of other sentences
  of the same article.
- `wiki_wordppl` (loglikelihood_rolling): word and byte perplexity and bits per byte of
  each article, as lm-eval's `wikitext` task scores its documents.

On first use the data is generated (deterministically: a fixed seed) into the quantkit
cache as jsonl, and the task YAMLs of this folder are rendered next to it with their
`data_files` pointing there; that folder is what lm-eval's `include_path` gets.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path

from quantkit.errors import QuantkitError

VERSION = 1  # bump when the generated data changes: the cache folder is per version
TASKS = ("wiki_cloze", "wiki_wordppl")
CLOZE_ITEMS = 500
CLOZE_SEED = 1234
DISTRACTORS = 3
_TEMPLATES = Path(__file__).parent

_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_CLOZE = re.compile(r"(\S.*\S)\s+([a-z]{3,})\.")  # context, a lowercase last word, a full stop


def sentences(documents: list[str]) -> list[str]:
    """Sentences of the documents in order: each line split after . ! or ? followed by a capital."""
    return [s for doc in documents for line in doc.splitlines() for s in _SENTENCE_BREAK.split(line.strip()) if s]


def cloze_pair(sentence: str, min_words: int = 8, max_words: int = 40) -> tuple[str, str] | None:
    """(context, last word) of a sentence of min_words..max_words words ending in a
    lowercase word of 3+ letters and a full stop; None for any other sentence."""
    m = _CLOZE.fullmatch(sentence)
    if m is None or not min_words <= len(sentence.split()) <= max_words:
        return None
    return m[1], m[2]


def cloze_items(documents: list[str], n: int = CLOZE_ITEMS, seed: int = CLOZE_SEED) -> list[dict]:
    """`n` items {"id", "context", "choices", "gold"} drawn with `random.Random(seed)` from
    the usable sentences. The distractors are last words of other sentences of the same
    document (on topic, so harder than random words), or of any document when it has
    too few."""
    pairs = [(d, *p) for d, doc in enumerate(documents) for s in sentences([doc]) if (p := cloze_pair(s))]
    by_doc: dict[int, set[str]] = {}
    for d, _, word in pairs:
        by_doc.setdefault(d, set()).add(word)
    every = sorted({word for _, _, word in pairs})
    if len(pairs) < n or len(every) <= DISTRACTORS:
        raise QuantkitError(
            f"the text gives {len(pairs)} usable sentences and {len(every)} distinct last words, "
            f"too few for {n} cloze items; use more text or fewer items."
        )
    pools = {d: sorted(words) if len(words) > DISTRACTORS else every for d, words in by_doc.items()}
    rng = random.Random(seed)
    items = []
    for i, k in enumerate(rng.sample(range(len(pairs)), n)):
        d, context, word = pairs[k]
        choices = [w for w in rng.sample(pools[d], DISTRACTORS + 1) if w != word][:DISTRACTORS]
        gold = rng.randrange(DISTRACTORS + 1)
        choices.insert(gold, word)
        items.append({"id": i, "context": context, "choices": choices, "gold": gold})
    return items


def wordppl_items(documents: list[str]) -> list[dict]:
    return [{"id": i, "text": doc} for i, doc in enumerate(documents)]


def _write_jsonl(path: Path, items: list[dict]) -> None:
    path.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items), encoding="utf-8")


def write_task_folder(folder: Path, documents: list[str], final: Path | None = None) -> None:
    """Write `<task>.jsonl` and `<task>.yaml` for every built-in task into `folder`; the
    YAMLs point at the jsonl files as they will be found in `final` (default `folder`)."""
    _write_jsonl(folder / "wiki_cloze.jsonl", cloze_items(documents))
    _write_jsonl(folder / "wiki_wordppl.jsonl", wordppl_items(documents))
    render_yamls(folder, final)


def render_yamls(folder: Path, final: Path | None = None) -> None:
    """(Re)write each task's YAML from its template where it differs (templates may change
    between versions; the data does not)."""
    for task in TASKS:
        data = json.dumps(str((final or folder) / f"{task}.jsonl"))
        text = (_TEMPLATES / f"{task}.yaml").read_text().replace("@DATA@", data)
        path = folder / f"{task}.yaml"
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)


def task_folder() -> Path:
    """The folder of built-in task YAMLs and data in the quantkit cache, built on first use."""
    from quantkit.assets import cache_dir
    from quantkit.calibration.datasets import load_documents

    dest = cache_dir() / "eval_tasks" / f"v{VERSION}"
    if all((dest / f"{task}.jsonl").is_file() for task in TASKS):
        render_yamls(dest)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".building-"))
    try:
        write_task_folder(tmp, load_documents("wiki", "eval"), final=dest)
        shutil.rmtree(dest, ignore_errors=True)  # an incomplete folder from an interrupted run
        os.replace(tmp, dest)
    except OSError:
        if not dest.is_dir():  # else another process finished first: keep its folder
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
