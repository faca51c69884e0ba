"""Corpus discovery, tokenization and the token cache.

The default corpus is the running interpreter's own standard library (`.py` files under
`sysconfig.get_paths()["stdlib"]`): real code documents whose lengths vary over four orders of
magnitude. A user corpus is a folder of text files or a JSONL file. Documents are sorted by path
(or line number) so every process sees the same corpus.

Byte-level tokens (UTF-8 bytes, vocabulary 256) are cached as one `.npz` of tokens plus document
offsets, keyed by a hash of the file list, sizes and mtimes (the corpus hash), so later
processes load it instead of re-reading thousands of files.

[Note: token-cache] Subword tokens (`unbroken.data.tokenizer`) are produced once per corpus and
tokenizer, never on a trainer's critical path: the CLI calls `corpus_for` before any rank starts
(`unbroken.api`), which under a per-corpus file lock trains the BPE (cached as
`bpe-<corpus hash>-<max docs>-v<vocab>.json`) and writes the ids to
`tokens-<corpus hash>-<max docs>-<tokenizer hash>/` (`tokens.npy`, `offsets.npy`, the
`tokenizer.json`, `meta.json`), renamed into place whole. Trainers find both by name and map
`tokens.npy` read-only (`np.load(mmap_mode="r")`: every rank shares the page cache). A process
that finds no cache (a harness that skipped the CLI) builds it under the same lock, so ranks
starting together build it once. Each document is encoded on its own, so document boundaries
are exactly the byte corpus's.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import itertools
import json
import os
import shutil
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from unbroken.config import DataConfig
from unbroken.errors import UserError

__all__ = ["VOCAB_SIZE", "Corpus", "cache_dir", "corpus_for", "load_corpus"]

VOCAB_SIZE = 256
"""Byte-level vocabulary: one token per byte value."""


@dataclass(frozen=True, slots=True)
class Corpus:
    """A tokenized corpus: all documents' tokens back to back, and their offsets.

    Attributes:
        tokens: every document's token ids, concatenated: uint8 bytes, or uint16/uint32 ids of
            a subword tokenizer (a read-only memory map of the token cache).
        offsets: int64 array of length n_docs + 1; document d is tokens[offsets[d]:offsets[d+1]].
        name: a short description for logs.
        vocab_size: number of token ids the tokenizer can produce.
        tokenizer: "bytes", or "bpe:HASH" / "file:HASH" (HASH: the tokenizer.json's, 16 hex).
    """

    tokens: np.ndarray
    offsets: np.ndarray
    name: str
    vocab_size: int = VOCAB_SIZE
    tokenizer: str = "bytes"

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


def _source(spec: str, jsonl_field: str) -> tuple[str, Callable[[], Corpus]]:
    """(corpus hash, builder of its byte-level corpus) for a corpus spec; only stats files.

    Raises:
        UserError: the path does not exist, or a folder holds no files.
    """
    if spec == "stdlib":
        files = _stdlib_files()
        return _fingerprint("stdlib", files), lambda: _from_documents(
            [f.read_bytes() for f in files], "stdlib"
        )
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
        return _fingerprint("dir", files), lambda: _from_documents(
            [f.read_bytes() for f in files], str(path)
        )
    return _fingerprint("jsonl", [path], jsonl_field), lambda: _from_documents(
        _read_jsonl(path, jsonl_field), str(path)
    )


def _first(corpus: Corpus, max_documents: int) -> Corpus:
    if not max_documents or max_documents >= corpus.n_docs:
        return corpus
    end = corpus.offsets[max_documents]
    return Corpus(
        tokens=corpus.tokens[:end],
        offsets=corpus.offsets[: max_documents + 1],
        name=f"{corpus.name}[:{max_documents}]",
        vocab_size=corpus.vocab_size,
        tokenizer=corpus.tokenizer,
    )


@functools.lru_cache(maxsize=4)
def load_corpus(
    spec: str,
    *,
    jsonl_field: str = "text",
    max_documents: int = 0,
    tokenizer: str = "bytes",
    vocab_size: int = 0,
) -> Corpus:
    """Load and tokenize a corpus (through the token cache, [Note: token-cache]).

    Args:
        spec: "stdlib", a folder of text files, or a path to a .jsonl file.
        jsonl_field: the JSON key holding each document's text.
        max_documents: keep only the first K documents (0 = all); a BPE is trained on them.
        tokenizer: "bytes", "bpe" (trained on this corpus) or the path of a tokenizer.json.
        vocab_size: the BPE's vocabulary (tokenizer "bpe" only).

    Memoized per process: a pre-initialized (shadow) trainer loads it before it is promoted.

    Raises:
        UserError: the path does not exist, the corpus holds no text, or the tokenizer file is
            unusable.
    """
    key, build = _source(spec, jsonl_field)
    if tokenizer == "bytes":
        return _first(_cached(key, build), max_documents)
    if tokenizer == "bpe" and vocab_size <= 256:
        raise UserError(f"data.vocab_size must exceed 256 for a BPE, got {vocab_size}")
    scope = f"{key}-{max_documents}"
    return _tokenized(
        scope, tokenizer, vocab_size, lambda: _first(_cached(key, build), max_documents)
    )


def corpus_for(data: DataConfig) -> Corpus:
    """The job's corpus, tokenized as `data` says (its tokenizer resolved by `JobConfig`).

    Raises:
        UserError: as `load_corpus`.
        ValueError: `data.tokenizer` is still "auto" (a `DataConfig` built outside a job).
    """
    if data.tokenizer == "auto":
        raise ValueError("data.tokenizer 'auto' is resolved by JobConfig from the model preset")
    return load_corpus(
        data.corpus,
        jsonl_field=data.jsonl_field,
        max_documents=data.max_documents,
        tokenizer=data.tokenizer,
        vocab_size=data.vocab_size if data.tokenizer == "bpe" else 0,
    )


@contextlib.contextmanager
def _locked(scope: str) -> Iterator[None]:
    """Exclusive per-corpus lock of the token cache (processes of one machine)."""
    with open(cache_dir() / f"corpus-{scope}.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _tokenizer_json(
    scope: str, tokenizer: str, vocab_size: int, raw: Callable[[], Corpus]
) -> tuple[str, str]:
    """(kind, tokenizer.json text): the user's file, or the BPE trained on this corpus (cached
    by corpus hash and vocabulary; trained here on a miss — call under `_locked(scope)`)."""
    from unbroken.data import tokenizer as tk

    if tokenizer != "bpe":
        return "file", tk.load_tokenizer_json(Path(tokenizer))
    path = cache_dir() / f"bpe-{scope}-v{vocab_size}.json"
    if not path.exists():
        _write_atomic(path, tk.train_bpe(_documents(raw()), vocab_size))
    return "bpe", path.read_text(encoding="utf-8")


def _read_tokens(folder: Path) -> Corpus | None:
    """The cached token ids in `folder`, mapped read-only; None if absent or torn."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        return Corpus(
            tokens=np.load(folder / "tokens.npy", mmap_mode="r", allow_pickle=False),
            offsets=np.load(folder / "offsets.npy", allow_pickle=False),
            name=meta["name"],
            vocab_size=meta["vocab_size"],
            tokenizer=meta["tokenizer"],
        )
    except (OSError, ValueError, KeyError):
        return None


def _tokenized(scope: str, tokenizer: str, vocab_size: int, raw: Callable[[], Corpus]) -> Corpus:
    """The corpus `raw()` in subword ids through the token cache ([Note: token-cache])."""
    from unbroken.data import tokenizer as tk

    # Fast path of every trainer: the tokenizer and its ids are cached; no lock, no build.
    known = cache_dir() / f"bpe-{scope}-v{vocab_size}.json" if tokenizer == "bpe" else None
    with contextlib.suppress(OSError, UnicodeDecodeError):
        text = (known or Path(tokenizer)).read_text(encoding="utf-8")
        cached = _read_tokens(cache_dir() / f"tokens-{scope}-{tk.text_hash(text)}")
        if cached is not None:
            return cached
    with _locked(scope):
        kind, text = _tokenizer_json(scope, tokenizer, vocab_size, raw)
        folder = cache_dir() / f"tokens-{scope}-{tk.text_hash(text)}"
        if _read_tokens(folder) is None:
            shutil.rmtree(folder, ignore_errors=True)  # torn: rebuilt, never trusted
            _write_tokens(folder, kind, text, tokenizer, raw())
    cached = _read_tokens(folder)
    if cached is None:
        raise UserError(f"the token cache {folder} cannot be read back (disk full?)")
    return cached


def _write_tokens(folder: Path, kind: str, text: str, source: str, corpus: Corpus) -> None:
    """Encode `corpus` with the tokenizer `text` into the cache folder, renamed in whole."""
    from tokenizers import Tokenizer

    from unbroken.data import tokenizer as tk

    digest = tk.text_hash(text)
    tokens, offsets = tk.encode_documents(text, _documents(corpus))
    meta = {
        "name": f"{corpus.name} ({kind} {digest})",
        "vocab_size": Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True),
        "tokenizer": f"{kind}:{digest}",
        "source": source,
        "documents": corpus.n_docs,
        "tokens": len(tokens),
    }
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    np.save(tmp / "tokens.npy", tokens)
    np.save(tmp / "offsets.npy", offsets)
    (tmp / "tokenizer.json").write_text(text, encoding="utf-8")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    os.rename(tmp, folder)


def _documents(corpus: Corpus) -> list[bytes]:
    bounds = corpus.offsets.tolist()
    return [corpus.tokens[a:b].tobytes() for a, b in itertools.pairwise(bounds)]


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
