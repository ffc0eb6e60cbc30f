"""The C++ CPU kernels, each a source beside its operation's Python (`kernels/<op>/*.cpp`), built on
first use (`Extension`): the paged attention (`ATTENTION`, attention/attention.cpp), the element-wise
steps (`elementwise.cpp`), the AMX int4 GEMM (`int4.cpp`) and the W8A8 passes (`int8.cpp`).

`load()` returns the ops (for the attention, `torch.ops.quantkit_cpu`: `paged_attention`,
`paged_prefill`) or None, and `reason()` says why it is None: `QUANTKIT_NO_EXT=1` is set, no
C++ compiler or ninja, the CPU lacks what the source needs, or the build failed (with the
first error line). Callers keep their torch path for None, so a machine that cannot build
loses speed, nothing else.

The build is `torch.utils.cpp_extension.load` with the system compiler (`$CXX`, else `c++`)
and ninja, `-O3 -march=native -fopenmp`, about a minute on two cores. It goes to
`$QUANTKIT_CACHE/ext/<name>-<key>` (default `~/.cache/quantkit`), where the key hashes the
source, the headers it includes (`cpu_isa.h`) and its path (two checkouts of one source build
apart: ninja would rebuild each one's on the other's command), torch's path, the build flags,
the torch, Python and compiler versions and the CPU's flags: a library built for one CPU is
never loaded on another. Processes that start at once build
once: an flock on `<dir>.lock` (dropped by the kernel if its holder dies) serialises them,
and under it a `lock` file that torch's own build lock left behind, from a build that was
killed, is stale and removed (torch would wait on it forever). A failed build writes
`failed.txt` in its folder, so later processes do not try the same build again (delete the
file to retry). The outcome is kept for the life of the process.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from quantkit.errors import QuantkitError

log = logging.getLogger(__name__)

ROOT = Path(__file__).parent  # the sources lie beside their operation's Python: attention/attention.cpp
_ARCH = "-march=native" if platform.machine().lower() in ("x86_64", "amd64", "i686") else "-mcpu=native"
CFLAGS = ["-O3", _ARCH, "-ffp-contract=fast", "-fopenmp"]
LDFLAGS = ["-fopenmp"]  # links the libgomp that torch has loaded already (same soname): one OpenMP runtime
ISAS = ("avx2", "avx512")  # the code paths of the AVX kernels (int4_avx.cpp, w8a8_avx.cpp)
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
ISA_ENV = os.environ.get("QUANTKIT_ISA", "").strip().lower()  # read once, at import: forces one of ISAS


def choose_isa(extension: Extension, isa: str | None = None, avx512: str = "AVX-512") -> tuple[str | None, str]:
    """(isa, "") for the AVX kernels of `extension` to run (`isa`, else QUANTKIT_ISA, else the
    widest its `isa_level()` op reports: 1 AVX2 + FMA, 2 `avx512`), or (None, why)."""
    want = isa or ISA_ENV or "auto"
    if want not in ("auto", *ISAS):
        raise QuantkitError(f"QUANTKIT_ISA / isa {want!r} is unknown; use avx2 or avx512 (or leave it unset).")
    ops = extension.load()
    level = 0 if ops is None else int(ops.isa_level())
    if level == 0:
        return None, extension.reason() or "this CPU has no AVX2 + FMA"
    if want == "avx512" and level < 2:
        return None, f"{avx512} was asked for (QUANTKIT_ISA or isa=) but this CPU or its OS has none"
    return ("avx512" if level == 2 else "avx2") if want == "auto" else want, ""


def cache_root() -> Path:
    """$QUANTKIT_CACHE, default ~/.cache/quantkit (as `quantkit.assets.cache_dir`; kernels may not import it)."""
    return Path(os.environ.get("QUANTKIT_CACHE") or Path.home() / ".cache" / "quantkit")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):  # x86, arm
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def _compiler_version(cxx: str) -> str:
    done = subprocess.run([cxx, "--version"], capture_output=True, text=True)
    return done.stdout.splitlines()[0] if done.stdout else ""


def local_includes(source: Path) -> list[Path]:
    """The files `source` includes by `#include "..."` (the shared `cpu_isa.h`), and theirs, in
    order; a source that includes itself (the AVX kernels' second pass) is not repeated."""
    found: list[Path] = []
    pending = [source.resolve()]
    while pending:
        current = pending.pop(0)
        for match in _INCLUDE.finditer(current.read_text()):
            path = (current.parent / match.group(1)).resolve()
            if path != source.resolve() and path not in found and path.exists():
                found.append(path)
                pending.append(path)
    return found


def build_key(cxx: str, source: Path) -> str:
    """16 hex digits naming one build: source and the headers it includes (their text, and where
    the source lies), flags, torch (and where it is installed), Python, compiler and CPU. Where the
    source and torch's headers lie are in ninja's build command: two checkouts with the same source
    sharing one folder made each one's ninja rebuild the other's library, minutes of CPU every time
    they alternated."""
    h = hashlib.sha256(source.read_bytes())
    for header in local_includes(source):
        h.update(header.read_bytes())
    where = (str(source.resolve()), str(Path(torch.__file__).resolve().parent))
    for part in (CFLAGS, LDFLAGS, torch.__version__, sys.version, _compiler_version(cxx), _cpu_flags(), where):
        h.update(repr(part).encode())
    return h.hexdigest()[:16]


def _first_error(message: str) -> str:
    """The compiler's first `error:` line of a failed build's output, else its first line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line.lower() or "fatal error" in line.lower()]
    return (errors or lines or ["unknown error"])[0][:300]


def locked_build(directory: Path, build) -> object:
    """`build()` under an flock on `<directory>.lock`; a failure is written to
    `directory/failed.txt` and raised again (as RuntimeError with its first error line) in
    this and later processes without building."""
    import fcntl

    directory.mkdir(parents=True, exist_ok=True)
    failed = directory / "failed.txt"
    with open(str(directory) + ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            if failed.exists():
                raise RuntimeError(failed.read_text())
            (directory / "lock").unlink(missing_ok=True)  # torch's, left by a killed build: we hold the flock
            try:
                return build()
            except Exception as e:
                failed.write_text(_first_error(str(e)))
                raise RuntimeError(failed.read_text()) from None
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Extension:
    """One C++ source under `kernels/` (`source`, e.g. "attention/attention.cpp"), built on the first
    `load()` of the process into `$QUANTKIT_CACHE/ext/<prefix>-<key>` and registered as
    `torch.ops.<namespace>`; `load()` is None and `reason()` says why when it cannot be.
    `needs(flags)`, given /proc/cpuinfo's flags, may name a CPU feature the source requires (then
    nothing is built)."""

    def __init__(self, source: str, namespace: str, probe: str, what: str, needs=None, prefix: str | None = None):
        self.source, self.namespace, self.probe, self.what = ROOT / source, namespace, probe, what
        self.prefix, self.needs = prefix or Path(source).stem.split("_")[0], needs
        self._lock = threading.Lock()
        self._result: tuple[object | None, str] | None = None  # (ops, reason), once per process

    def load(self):
        """`torch.ops.<namespace>`, or None (see `reason()`)."""
        if os.environ.get("QUANTKIT_NO_EXT") == "1":
            return None
        if self._result is None:
            with self._lock:
                if self._result is None:
                    self._result = self._build()
                    if self._result[0] is None:
                        log.warning("%s are unavailable (%s); using the torch path", self.what, self._result[1])
        return self._result[0]

    def reason(self) -> str:
        """Why `load()` gives None ("" when it gives the ops)."""
        if os.environ.get("QUANTKIT_NO_EXT") == "1":
            return "disabled by QUANTKIT_NO_EXT=1"
        self.load()
        return self._result[1]

    def _build(self) -> tuple[object | None, str]:
        missing = self.needs(_cpu_flags()) if self.needs else None
        if missing:
            return None, missing
        if not self.source.exists():
            return None, f"the source {self.source} is missing from this install"
        cxx = os.environ.get("CXX", "c++")
        if shutil.which(cxx) is None:
            return None, f"no C++ compiler ({cxx} not found; set $CXX or install g++)"
        if shutil.which("ninja") is None:
            try:
                import ninja  # the PyPI package: its binary, when the venv's bin/ is not on PATH

                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
            except ImportError:
                return None, "ninja is not installed (pip install ninja)"
        from torch.utils import cpp_extension

        directory = cache_root() / "ext" / f"{self.prefix}-{build_key(cxx, self.source)}"
        name = f"quantkit_{self.prefix}"

        def build() -> str:
            start, built = time.perf_counter(), (directory / f"{name}.so").exists()
            if not built:
                log.info("building %s into %s (once per machine, about a minute)", self.what, directory)
            path = cpp_extension.load(
                name,
                [str(self.source)],
                extra_cflags=list(CFLAGS),  # copies: torch appends to the lists it is given
                extra_ldflags=list(LDFLAGS),
                build_directory=str(directory),
                is_python_module=False,
                verbose=False,
            )
            if not built:
                log.info("built %s in %.1f s", self.what, time.perf_counter() - start)
            return path

        ops = getattr(torch.ops, self.namespace)
        try:
            if not hasattr(ops, self.probe):  # not loaded already
                locked_build(directory, build)
        except Exception as e:  # a failed build must never break the caller: the torch path remains
            return None, f"the build failed: {_first_error(str(e))}"
        return ops, ""


ATTENTION = Extension("attention/attention.cpp", "quantkit_cpu", "paged_attention", "the C++ CPU attention kernels")
load, reason = ATTENTION.load, ATTENTION.reason  # the attention kernels' (`cpu_attention` calls these)
