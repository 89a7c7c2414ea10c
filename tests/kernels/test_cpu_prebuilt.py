"""The prebuilt-kernel folder (kernels/cpu/prebuilt.py): ``python -m kvpilot.kernels.cpu`` fills
it, a process loads from it without touching torch's extension cache, and a stale stamp or a
corrupt library falls back to that cache.

Each case runs in a fresh interpreter (a process imports an extension once). Nothing compiles
here while torch's cache holds current builds (``make install`` leaves them); without them the
first test builds them once (about a minute each), like the other CPU kernel tests, and needs a
C++ compiler.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import stat
import subprocess
import sys

import pytest

from kvpilot.kernels.cpu import elementwise, extension, paged_attention, prebuilt

NAME = paged_attention.EXTENSION_NAME

# Loads the paged attention kernel, checks it against softmax(q k^T * scale) v computed with
# torch ops on one GQA sequence spread over two shuffled blocks, prints the library's path.
CHECK = """
import logging, sys
import torch
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from kvpilot.kernels.cpu import paged_attention

gen = torch.Generator().manual_seed(0)
block_size, num_heads, num_kv_heads, head_dim, seq_len = 4, 4, 2, 8, 6
k_cache = torch.randn(3, block_size, num_kv_heads, head_dim, generator=gen)
v_cache = torch.randn(3, block_size, num_kv_heads, head_dim, generator=gen)
query = torch.randn(1, num_heads, head_dim, generator=gen)
table = torch.tensor([[2, 0]], dtype=torch.int32)
out = paged_attention.paged_attention(
    query, k_cache, v_cache, table, torch.tensor([seq_len], dtype=torch.int32), 0.25
)
rows = table[0].long()
k = k_cache[rows].reshape(-1, num_kv_heads, head_dim)[:seq_len].repeat_interleave(2, dim=1)
v = v_cache[rows].reshape(-1, num_kv_heads, head_dim)[:seq_len].repeat_interleave(2, dim=1)
weights = torch.softmax(torch.einsum("hd,thd->ht", query[0], k) * 0.25, dim=-1)
expected = torch.einsum("ht,thd->hd", weights, v)
torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-5)
print(paged_attention.load_extension().__file__)
"""


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=900,  # bounds a hang only; a cold cache builds a kernel in about a minute
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _loaded_from(done: subprocess.CompletedProcess[str]) -> pathlib.Path:
    return pathlib.Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def prebuilt_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A prebuilt folder filled by ``python -m kvpilot.kernels.cpu`` (from torch's cache)."""
    root = tmp_path_factory.mktemp("cpu-kernels")
    done = subprocess.run(
        [sys.executable, "-m", "kvpilot.kernels.cpu"],
        env={**os.environ, prebuilt.ENV_VAR: str(root)},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{NAME}: prebuilt at {root / NAME}.so" in done.stdout
    return root


@pytest.fixture
def copy_of_prebuilt(prebuilt_dir: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    """A copy of the prebuilt folder for a test to spoil."""
    return pathlib.Path(shutil.copytree(prebuilt_dir, tmp_path / "cpu-kernels"))


def test_the_command_installs_each_kernel_with_a_current_stamp(prebuilt_dir):
    kernels = [paged_attention.KERNEL]
    if elementwise.enabled():
        kernels.append(elementwise.KERNEL)
    for kernel in kernels:
        library = prebuilt.library_path(kernel.name, prebuilt_dir)
        stamp = json.loads(prebuilt.stamp_path(kernel.name, prebuilt_dir).read_text())
        assert stamp["fingerprint"] == kernel.fingerprint()
        assert stat.S_IMODE(library.stat().st_mode) == 0o644  # readable by the pods' user
    assert not [p for p in prebuilt_dir.iterdir() if p.name.startswith(".")]  # no temp files


def test_a_fresh_home_loads_the_prebuilt_kernel_without_writing(prebuilt_dir, tmp_path):
    # An engine pod: an empty HOME and extension cache it cannot write, a read-only image.
    home, cache = tmp_path / "home", tmp_path / "torch_extensions"
    for folder in (home, cache):
        folder.mkdir()
        folder.chmod(0o555)
    prebuilt_dir.chmod(0o555)
    try:
        done = _run(
            CHECK,
            HOME=str(home),
            TORCH_EXTENSIONS_DIR=str(cache),
            **{prebuilt.ENV_VAR: str(prebuilt_dir)},
        )
    finally:
        prebuilt_dir.chmod(0o755)
    assert _loaded_from(done) == prebuilt_dir / f"{NAME}.so"
    assert list(cache.iterdir()) == [] and list(home.iterdir()) == []
    assert sorted(p.name for p in prebuilt_dir.iterdir() if p.name.startswith(NAME)) == [
        f"{NAME}.json",
        f"{NAME}.so",
    ]


def test_a_stale_stamp_falls_back_to_the_build_cache(copy_of_prebuilt):
    stamp_file = prebuilt.stamp_path(NAME, copy_of_prebuilt)
    stamp = json.loads(stamp_file.read_text())
    stamp["fingerprint"]["source_sha256"] = "0" * 64  # as if the source had changed since
    stamp_file.write_text(json.dumps(stamp))
    done = _run(CHECK, **{prebuilt.ENV_VAR: str(copy_of_prebuilt)})
    assert _loaded_from(done) == extension.build_folder(NAME) / f"{NAME}.so"
    assert f"prebuilt {NAME} is stale (source_sha256 differ)" in done.stderr
    assert "WARNING:kvpilot" not in done.stderr


def test_a_corrupt_library_warns_and_falls_back_to_the_build_cache(copy_of_prebuilt):
    prebuilt.library_path(NAME, copy_of_prebuilt).write_bytes(b"not an ELF file")
    done = _run(CHECK, **{prebuilt.ENV_VAR: str(copy_of_prebuilt)})
    assert _loaded_from(done) == extension.build_folder(NAME) / f"{NAME}.so"
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING:kvpilot")]
    assert len(warnings) == 1 and f"prebuilt {NAME} at" in warnings[0], done.stderr
    assert "failed to load" in warnings[0] and "building it instead" in warnings[0]


def test_a_missing_folder_is_the_build_cache_path_without_a_word(tmp_path):
    done = _run(CHECK, **{prebuilt.ENV_VAR: str(tmp_path / "absent")})
    assert _loaded_from(done) == extension.build_folder(NAME) / f"{NAME}.so"
    assert "prebuilt" not in done.stderr
    assert not (tmp_path / "absent").exists()


def test_a_changed_header_changes_the_build_flags_and_so_the_stamp(tmp_path):
    """torch's build cache and the stamp hash the source file and the flags; a header the
    source includes is in the flags by its hash, so editing it rebuilds the kernel."""
    source, header = tmp_path / "k.cpp", tmp_path / "k.h"
    source.write_text('#include "k.h"\n')
    header.write_text("// one\n")
    kernel = extension.Kernel("k", source, "k", "none", headers=(header,))
    before = kernel.cflags
    assert before[:-1] == extension.CFLAGS and before[-1].startswith("-DKVPILOT_HEADERS_SHA256=")
    header.write_text("// two\n")
    assert kernel.cflags[-1] != before[-1]
    assert kernel.fingerprint()["cflags"] == kernel.cflags
    assert extension.Kernel("k", source, "k", "none").cflags == extension.CFLAGS
    assert elementwise.KERNEL.headers == (elementwise.SOURCE.with_name("silu.h"),)
