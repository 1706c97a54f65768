"""The pixel kernels' compile cache (qvl_trt/mm/kernel_cache.py), as the python models use it:
processes importing qvl_trt from a repository's runtime zip. The first ones compile and save,
the next loads (numba's per-dispatcher cache hits and misses count it, no timing); a changed
kernels.py compiles again; processes starting together all finish with the same pixels; the
save holds the folder's lock; an unwritable cache folder only costs the compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from qvl_trt.mm import kernel_cache, kernels

# One vertical pass over a 6x5 plane, as C-contiguous rows or ("strided") every other column
# of a wider plane: two signatures. Prints numba's cache hits and misses and the output.
PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
from qvl_trt.mm import kernels
assert kernels.__file__.startswith(sys.argv[1]), kernels.__file__
out = []
for layout in sys.argv[2:]:
    plane = np.arange(60, dtype=np.uint8).reshape(6, 10) * 3
    plane = plane[:, ::2] if layout == "strided" else np.ascontiguousarray(plane[:, :5])
    bounds = np.array([[0, 3], [2, 3], [3, 3]], np.int32)
    weights = np.array([[1 << 20, 2 << 20, 1 << 20]] * 3, np.int32)
    dst = np.empty((3, 5), np.uint8)
    kernels.vertical_pass(plane, dst, bounds, weights, 22)
    out.append(dst.tolist())
stats = kernels.vertical_pass.stats
print(json.dumps({"hits": sum(stats.cache_hits.values()),
                  "misses": sum(stats.cache_misses.values()), "out": out}))
"""


@pytest.fixture(scope="module")
def runtime_zip(tmp_path_factory) -> Path:
    from qvl_trt.triton.repository import write_runtime_zip

    return write_runtime_zip(tmp_path_factory.mktemp("runtime") / "qvl_trt_runtime.zip")


def probe(runtime: Path, cache: Path, *layouts: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PROBE, str(runtime), *layouts],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "NUMBA_CACHE_DIR": str(cache)})


def result(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-2000:]
    return {**json.loads(out), "stderr": err}


def expected(*layouts: str) -> list:
    """The probe's output by numpy: each output row is (a + 2b + c) / 4 of three source rows,
    rounded half up, as the 22-bit weights say."""
    out = []
    for layout in layouts:
        plane = np.arange(60, dtype=np.uint8).reshape(6, 10) * 3
        plane = (plane[:, ::2] if layout == "strided" else plane[:, :5]).astype(np.int64)
        rows = [(plane[f] + 2 * plane[f + 1] + plane[f + 2] + 2) >> 2 for f in (0, 2, 3)]
        out.append(np.clip(rows, 0, 255).tolist())
    return out


def test_processes_starting_together_compile_once_then_load(tmp_path, runtime_zip) -> None:
    """Three processes compile the two signatures at once, in different orders, each with
    the right pixels; the next process loads both (each under its own data file) and
    compiles nothing; a changed kernels.py compiles again, in a folder of its own."""
    orders = [("rows", "strided"), ("strided", "rows"), ("strided",)]
    started = [probe(runtime_zip, tmp_path, *order) for order in orders]
    want = dict(zip(("rows", "strided"), expected("rows", "strided"), strict=True))
    for order, process in zip(orders, started, strict=True):
        done = result(process)
        assert done["out"] == [want[layout] for layout in order]
        assert done["misses"] >= 1  # nothing was there to load
    after = result(probe(runtime_zip, tmp_path, "rows", "strided"))
    assert (after["hits"], after["misses"], after["out"]) == (2, 0, list(want.values()))
    source = zipfile.ZipFile(runtime_zip).read("qvl_trt/mm/kernels.py")
    folder = tmp_path / kernel_cache.FOLDER / kernel_cache.cache_dir(source).name
    assert len(list(folder.glob("kernels.vertical_pass-*.nbc"))) == 2

    changed = tmp_path / "changed.zip"
    with zipfile.ZipFile(runtime_zip) as src, zipfile.ZipFile(changed, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename == "qvl_trt/mm/kernels.py":
                data += b"\n# one more line\n"
            dst.writestr(item, data)
    again = result(probe(changed, tmp_path, "rows"))
    assert (again["hits"], again["misses"]) == (0, 1)  # nothing stale is loaded
    assert sorted(p.name for p in (tmp_path / kernel_cache.FOLDER).iterdir()) == sorted(
        [folder.name, kernel_cache.cache_dir(source + b"\n# one more line\n").name])


def test_a_save_waits_for_the_folders_lock(tmp_path, runtime_zip) -> None:
    """While another process holds the lock, a compile cannot save: the probe waits in
    flock (seen in /proc/locks, no timing), and finishes once the lock is let go."""
    import fcntl

    source = zipfile.ZipFile(runtime_zip).read("qvl_trt/mm/kernels.py")
    folder = kernel_cache.cache_dir(source).relative_to(kernel_cache.cache_root())
    lock = tmp_path / folder / ".lock"
    lock.parent.mkdir(parents=True)
    with open(lock, "a+b") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        process = probe(runtime_zip, tmp_path, "rows")
        inode = f":{lock.stat().st_ino} "
        deadline = time.monotonic() + 300  # a hang guard, not a measurement
        while not any("->" in line and inode in line
                      for line in Path("/proc/locks").read_text().splitlines()):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the probe never waited for the lock"
            time.sleep(0.05)
        assert not any(lock.parent.glob("*.nbi"))  # nothing saved while the lock is held
    assert result(process)["misses"] == 1
    assert any(lock.parent.glob("*.nbi"))


def test_an_unwritable_cache_folder_compiles_in_memory(tmp_path, runtime_zip) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = result(probe(runtime_zip, blocker / "cache", "rows"))
    assert (done["hits"], done["misses"]) == (0, 1)
    assert done["out"] == expected("rows")
    line = next(x for x in done["stderr"].splitlines() if "cannot write their cache" in x)
    assert "NUMBA_CACHE_DIR" in line


def test_this_process_uses_the_cache() -> None:
    """The kernels imported here are cached (tests and tritonservers share one folder)."""
    assert all(isinstance(k._cache, kernel_cache._KernelCache)
               for k in (kernels.vertical_pass, kernels.horizontal_pass,
                         kernels.write_patches, kernels._copy_patch_rows))
