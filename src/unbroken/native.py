"""Compile a C source of the package on first use and keep the library in a per-user cache.

Used by the erasure code's CPU kernel (`unbroken.erasure.native_backend`) and the lending
pool's raw allocator (`unbroken.update.lending`). The source is compiled with the system C
compiler (``$CC``, else ``cc``/``gcc``/``clang``) into ``$UNBROKEN_CACHE_DIR`` (or
``$XDG_CACHE_HOME/unbroken``, else ``~/.cache/unbroken``) under `sub`, named by a hash of the
source, flags and machine, and written by atomic rename so concurrent first uses in several
processes are safe. An unwritable cache falls back to ``$TMPDIR/unbroken-<uid>``.

Hand-written: a few lines over `subprocess`; setuptools' and torch's extension builders need a
build step or a C++ toolchain and headers that a plain C file with no includes beyond libc
does not.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["FLAGS", "NativeUnavailableError", "build_shared", "compiler"]

FLAGS = ("-O3", "-std=c11", "-shared", "-fPIC", "-fno-strict-aliasing")


class NativeUnavailableError(RuntimeError):
    """A native library cannot be built or loaded here (e.g. no C compiler)."""


def _cache_dir(sub: str) -> Path:
    root = os.environ.get("UNBROKEN_CACHE_DIR")
    if root:
        return Path(root) / sub
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg or Path.home() / ".cache") / "unbroken" / sub


def compiler(who: str = "unbroken") -> str:
    """The C compiler to use. Raises `NativeUnavailableError` naming `who` when there is none."""
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate):
            return candidate
    raise NativeUnavailableError(
        f"{who}: no C compiler found (set $CC or install gcc) to build the native library"
    )


def build_shared(
    source: Path, sub: str, flags: tuple[str, ...] = FLAGS, who: str = "unbroken"
) -> Path:
    """The compiled library of `source` (built once per source version, flags and machine).

    Raises:
        NativeUnavailableError: no compiler, no writable cache, or the build failed.
    """
    key = b"\0".join([source.read_bytes(), " ".join(flags).encode(), platform.machine().encode()])
    name = f"{source.stem.lstrip('_')}-{hashlib.sha256(key).hexdigest()[:16]}.so"
    for directory in (_cache_dir(sub), Path(tempfile.gettempdir()) / f"unbroken-{os.getuid()}"):
        target = directory / name
        if target.exists():
            return target
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue  # an unwritable cache: try the next place
        if os.access(directory, os.W_OK):
            _build(compiler(who), source, flags, target, who)
            return target
    raise NativeUnavailableError(f"{who}: no writable directory for the native library cache")


def _build(cc: str, source: Path, flags: tuple[str, ...], target: Path, who: str) -> None:
    """Compile into ``target`` through a private temporary file and an atomic rename, so
    concurrent first uses in several processes never load a half-written library."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [cc, *flags, "-o", tmp, str(source)], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise NativeUnavailableError(
                f"{who}: building {source.name} with {cc} failed:\n{result.stderr.strip()}"
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
