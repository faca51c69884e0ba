"""Parity values computed by Intel ISA-L alone, vendored, so every CPU backend is checked against
an independent implementation of the field arithmetic even where ISA-L cannot be loaded.

`isal_reference.json` was produced by ISA-L's own generator and encoder — `gf_gen_cauchy1_matrix`,
`ec_init_tables`, `ec_encode_data` through ctypes, nothing of `unbroken.erasure` but the library's
path — by this command, run from the repository root:

    .venv/bin/python tests/erasure/test_isal_reference.py > tests/erasure/isal_reference.json

The data of each case is a SHAKE-256 stream (no random-number generator whose stream could change
between versions). Where ISA-L loads (CI: pyeclib is in the `bench` extra), the vendored values
are recomputed and must match the file.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

VENDORED = Path(__file__).with_name("isal_reference.json")
CASES = [(1, 1, 64), (3, 2, 100), (10, 4, 4113), (32, 16, 1000), (64, 16, 1300), (200, 56, 96)]
"""(k, m, bytes per page): tiny codes, the default tier (240 + 16 is in test_code), k + m = 256."""


def case_data(k: int, length: int) -> np.ndarray:
    """The k data pages of a case: a SHAKE-256 stream keyed by (k, length)."""
    raw = hashlib.shake_256(f"unbroken/isal-reference/{k}/{length}".encode()).digest(k * length)
    return np.frombuffer(raw, dtype=np.uint8).reshape(k, length).copy()


def isal_parity(k: int, m: int, data: np.ndarray) -> np.ndarray:
    """Parity of `data` computed by ISA-L alone: its Cauchy generator, its tables, its encoder."""
    from unbroken.erasure.isal_backend import load_isal  # only finds and opens the library

    lib = load_isal()
    lib.gf_gen_cauchy1_matrix.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.gf_gen_cauchy1_matrix.restype = None
    length = data.shape[1]
    generator = np.zeros((k + m, k), dtype=np.uint8)  # identity on top, then the m parity rows
    lib.gf_gen_cauchy1_matrix(generator.ctypes.data, k + m, k)
    tables = np.zeros(32 * k * m, dtype=np.uint8)
    lib.ec_init_tables(k, m, generator[k:].ctypes.data, tables.ctypes.data)
    parity = np.zeros((m, length), dtype=np.uint8)
    data_ptrs = (ctypes.c_void_p * k)(*(data[i].ctypes.data for i in range(k)))
    parity_ptrs = (ctypes.c_void_p * m)(*(parity[i].ctypes.data for i in range(m)))
    lib.ec_encode_data(length, k, m, tables.ctypes.data, data_ptrs, parity_ptrs)
    return parity


def _record(k: int, m: int, length: int, parity: np.ndarray) -> dict:
    return {
        "k": k,
        "m": m,
        "length": length,
        "sha256": hashlib.sha256(parity.tobytes()).hexdigest(),
        "first_row_head": parity[0, :16].tobytes().hex(),
    }


def _vendored() -> dict[tuple[int, int, int], dict]:
    cases = json.loads(VENDORED.read_text())["cases"]
    return {(c["k"], c["m"], c["length"]): c for c in cases}


@pytest.mark.parametrize(("k", "m", "length"), CASES)
def test_backend_encodes_what_isal_encoded(backend, k, m, length):
    expected = _vendored()[(k, m, length)]
    codec = backend.make(k, m)
    data = case_data(k, length)
    pages = [backend.buffer(row) for row in data]
    parity = [backend.buffer(np.zeros(length, np.uint8)) for _ in range(m)]
    codec.encode(pages, parity)
    got = np.stack([backend.read(p) for p in parity])
    assert _record(k, m, length, got) == expected


@pytest.mark.ci_required  # pyeclib (ISA-L) is in the `bench` extra ./dev installs
def test_the_vendored_values_are_what_isal_computes():
    from unbroken.erasure.isal_backend import IsalUnavailableError

    try:
        records = [_record(k, m, n, isal_parity(k, m, case_data(k, n))) for k, m, n in CASES]
    except IsalUnavailableError as exc:
        pytest.skip(str(exc))
    assert json.loads(VENDORED.read_text())["cases"] == records


def main() -> int:
    records = [_record(k, m, n, isal_parity(k, m, case_data(k, n))) for k, m, n in CASES]
    command = (
        ".venv/bin/python tests/erasure/test_isal_reference.py > tests/erasure/" + VENDORED.name
    )
    json.dump({"command": command, "cases": records}, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
