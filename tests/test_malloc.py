import platform
import subprocess
import sys

import pytest

from quantkit.malloc import keep_freed_memory

GLIBC = platform.libc_ver()[0] == "glibc"

# In a fresh interpreter (the test process's heap is shaped by torch and pytest): 512 heap
# blocks of 64 KiB (below any mmap threshold), each followed by a block of the same size
# that stays allocated (a small one could come from the free lists, anywhere in the heap,
# depending on what the interpreter freed before), so the freed ones are holes the heap's
# top cannot be trimmed past; prints the
# resident MiB that freeing them released, then what trim_freed_memory released.
PROBE = """
import ctypes
from quantkit.malloc import trim_freed_memory

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
blocks = [(libc.malloc(64 << 10), libc.malloc(64 << 10)) for _ in range(512)]
for p, _ in blocks:
    ctypes.memset(p, 1, 64 << 10)
before = rss()
for p, _ in blocks:
    libc.free(p)
freed = rss()
assert trim_freed_memory()
print(before - freed, freed - rss())
"""


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_trim_hands_free_heap_pages_back():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    by_free, by_trim = map(float, out.split())
    assert by_free < 4  # freed holes stay resident ...
    assert by_trim > 24  # ... until trimmed (32 MiB of them; measured 31.7)


def test_keep_freed_memory_on_glibc():
    assert keep_freed_memory() is GLIBC
