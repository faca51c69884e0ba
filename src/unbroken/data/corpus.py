"""Corpus discovery and byte-level tokenization.

The default corpus is the running interpreter's own standard library (`.py` files under
`sysconfig.get_paths()["stdlib"]`): real code documents whose lengths vary over four orders of
magnitude. A user corpus is a folder of text files or a JSONL file. Documents are sorted by path
(or line number) so every process sees the same corpus. Tokens are UTF-8 bytes (vocabulary 256);
the tokenized corpus is cached as one `.npy` of tokens plus document offsets, keyed by a hash of
the file list, sizes and mtimes, so later processes map it instead of re-reading thousands of
files.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from unbroken.errors import UserError

__all__ = ["VOCAB_SIZE", "Corpus", "cache_dir", "load_corpus"]

VOCAB_SIZE = 256
"""Byte-level vocabulary: one token per byte value."""


@dataclass(frozen=True, slots=True)
class Corpus:
    """A tokenized corpus: all documents' tokens back to back, and their offsets.

    Attributes:
        tokens: uint8 array of every document's bytes, concatenated.
        offsets: int64 array of length n_docs + 1; document d is tokens[offsets[d]:offsets[d+1]].
        name: a short description for logs.
    """

    tokens: np.ndarray
    offsets: np.ndarray
    name: str

    @property
    def n_docs(self) -> int:
        return len(self.offsets) - 1

    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def cache_dir() -> Path:
    """Where tokenized corpora are cached (UNBROKEN_CACHE or ~/.cache/unbroken)."""
    root = os.environ.get("UNBROKEN_CACHE") or Path.home() / ".cache" / "unbroken"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = []
    # os.walk with pruning: never descend into site-packages (torch alone holds thousands of
    # files; a filtered rglob spent 0.4 s walking them on every start).
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted(files, key=lambda p: str(p.relative_to(root)))


def _text_files(folder: Path) -> list[Path]:
    files = [p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")]
    return sorted(files, key=lambda p: str(p.relative_to(folder)))


def _fingerprint(kind: str, paths: list[Path], extra: str = "") -> str:
    h = hashlib.sha256(f"{kind}|{extra}".encode())
    for p in paths:
        st = p.stat()
        h.update(f"{p}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _from_documents(docs: list[bytes], name: str) -> Corpus:
    docs = [d for d in docs if len(d) >= 2]
    if not docs:
        raise UserError(f"corpus {name} has no documents with text")
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.frombuffer(b"".join(docs), dtype=np.uint8)
    return Corpus(tokens=tokens, offsets=offsets, name=name)


def _cached(key: str, build) -> Corpus:
    path = cache_dir() / f"corpus-{key}.npz"
    if path.exists():
        try:
            with np.load(path, allow_pickle=False) as z:
                return Corpus(tokens=z["tokens"], offsets=z["offsets"], name=str(z["name"]))
        except (OSError, ValueError, KeyError):
            path.unlink(missing_ok=True)  # a torn cache file is rebuilt, never trusted
    corpus = build()
    tmp = path.with_suffix(f".tmp{os.getpid()}.npz")
    np.savez(tmp, tokens=corpus.tokens, offsets=corpus.offsets, name=np.array(corpus.name))
    os.replace(tmp, path)
    return corpus


@functools.lru_cache(maxsize=4)
def load_corpus(spec: str, *, jsonl_field: str = "text", max_documents: int = 0) -> Corpus:
    """Load and tokenize a corpus.

    Args:
        spec: "stdlib", a folder of text files, or a path to a .jsonl file.
        jsonl_field: the JSON key holding each document's text.
        max_documents: keep only the first K documents (0 = all).

    Memoized per process: a pre-initialized (shadow) trainer loads it before it is promoted.

    Raises:
        UserError: the path does not exist, or the corpus holds no text.
    """
    if spec == "stdlib":
        files = _stdlib_files()
        key = _fingerprint("stdlib", files)
        corpus = _cached(key, lambda: _from_documents([f.read_bytes() for f in files], "stdlib"))
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            raise UserError(
                f"corpus path not found: {path} (set data.corpus to 'stdlib', a folder of text "
                "files or a .jsonl file)"
            )
        if path.is_dir():
            files = _text_files(path)
            if not files:
                raise UserError(f"corpus folder {path} has no files")
            key = _fingerprint("dir", files)
            corpus = _cached(
                key, lambda: _from_documents([f.read_bytes() for f in files], str(path))
            )
        else:
            key = _fingerprint("jsonl", [path], jsonl_field)
            corpus = _cached(
                key, lambda: _from_documents(_read_jsonl(path, jsonl_field), str(path))
            )
    if max_documents and max_documents < corpus.n_docs:
        end = corpus.offsets[max_documents]
        corpus = Corpus(
            tokens=corpus.tokens[:end],
            offsets=corpus.offsets[: max_documents + 1],
            name=f"{corpus.name}[:{max_documents}]",
        )
    return corpus


def _read_jsonl(path: Path, field: str) -> list[bytes]:
    docs = []
    with path.open("rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
                raise UserError(
                    f"{path}:{lineno}: expected an object with a string field '{field}' "
                    "(set data.jsonl_field)"
                )
            docs.append(obj[field].encode("utf-8"))
    return docs
