"""Memory handed back to the operating system (wscompress.io.memory)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = """
import sys, torch
from wscompress.io.memory import return_large_frees
if sys.argv[1] == "on":
    return_large_frees()
big = torch.ones(4 << 20)  # 16 MB: glibc then serves everything below 16 MB from its heap
del big
held = [torch.ones(2 << 20) for _ in range(40)]  # 40 x 8 MB, freed below the last one
held = held[-1:]
print(next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:")) // 1024)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_large_frees_go_back_to_the_system():
    """Tensors freed below a live one stay resident on glibc's heap; with return_large_frees
    (what the ``wscompress`` command sets up, ``setup_process``) they are unmapped."""
    rss = {mode: int(subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                                    check=True).stdout) for mode in ("off", "on")}
    assert rss["on"] < rss["off"] - 200, rss


HUGE = """
import sys
if sys.argv[1] == "on":
    sys.argv[0] = "/usr/local/bin/wscompress"  # the command's console script
import wscompress
import torch
t = torch.ones(16 << 20)  # 64 MB
address, flags = t.data_ptr(), None
for line in open("/proc/self/smaps"):
    head = line.split()
    if "-" in head[0] and ":" not in head[0]:
        lo, hi = (int(v, 16) for v in head[0].split("-"))
        inside = lo <= address < hi
    elif inside and head[0] == "VmFlags:":
        flags = head[1:]
print("hg" in flags)
"""


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="a kernel with transparent huge pages")
def test_large_tensors_are_advised_onto_huge_pages():
    """What the command's process is set up with makes torch madvise(MADV_HUGEPAGE) its large
    tensors (VmFlags ``hg``); torch's own default does not."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    advised = {mode: subprocess.run([sys.executable, "-c", HUGE, mode], capture_output=True, text=True,
                                    check=True, env=env).stdout.strip() for mode in ("off", "on")}
    assert advised == {"off": "False", "on": "True"}


SPIN = """
import sys, time
if sys.argv[1] == "on":
    sys.argv[0] = "/usr/local/bin/wscompress"  # the command's console script
import wscompress  # loads transformers, which loads scipy's OpenBLAS
import numpy as np
from scipy.linalg.blas import ssyrk
x = np.random.default_rng(0).standard_normal((500, 4000), dtype=np.float32)
for _ in range(5):
    ssyrk(1.0, x)
start = time.process_time()
time.sleep(0.3)  # the process's own thread does nothing: what it spends is OpenBLAS's threads
print(time.process_time() - start)
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS runs threads only on several cores")
def test_blas_threads_sleep_once_a_call_ends():
    """What the command's process is set up with (before transformers loads scipy) makes
    OpenBLAS's threads sleep when a call ends; by default they spin ~0.1 s on the cores torch's
    next layer needs."""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", "OPENBLAS_NUM_THREADS",
                                                             "OMP_NUM_THREADS")}
    spent = {mode: float(subprocess.run([sys.executable, "-c", SPIN, mode], capture_output=True, text=True,
                                        check=True, env=env).stdout) for mode in ("off", "on")}
    assert spent["on"] < 0.25 * spent["off"], spent  # relative: a busy machine slows both


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps")
def test_file_backed_tells_a_mapped_checkpoint_from_process_memory(tmp_path):
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from wscompress.io.memory import file_backed

    save_file({"w": torch.ones(4096)}, tmp_path / "w.safetensors")
    with safe_open(tmp_path / "w.safetensors", "pt") as f:  # safetensors maps the file
        assert file_backed(f.get_tensor("w"))
    assert not file_backed(torch.ones(4096))


# what importing wscompress changes in the process's environment, in a program (torch imported
# first or not) and in the command's console script
IMPORT = """
import json, os, sys
if sys.argv[1] == "torch first":
    import torch
if sys.argv[1] == "command":
    sys.argv[0] = "/usr/local/bin/wscompress"
before = dict(os.environ)
import wscompress
print(json.dumps(sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))))
"""


def _child(arg: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "OPENBLAS_THREAD_TIMEOUT")}
    done = subprocess.run([sys.executable, "-c", IMPORT, arg], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_importing_wscompress_changes_nothing_process_wide():
    """A program's import leaves the environment (read by torch, OpenBLAS, glibc) as it was,
    whatever it imported before; only the command's own process is set up."""
    assert _child("torch first") == "[]"
    assert _child("wscompress first") == "[]"
    assert _child("command") == '["OPENBLAS_THREAD_TIMEOUT", "THP_MEM_ALLOC_ENABLE"]'
