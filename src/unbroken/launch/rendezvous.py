"""Where a node of a multi-node job finds the job, and the secret it proves it belongs with.

`resolve_join` turns what a launcher gives a node into a `NodeJoin`, in this order of
precedence, each source whole or not at all:

1. the command line: `--nnodes N --node-rank R --rdzv-endpoint HOST:PORT` (torchrun's names;
   `--nnodes N:M`, torchrun's elastic form, launches N nodes and lets M - N spare nodes join,
   with node ranks N..M-1, to stand in for lost ones);
2. the environment torchrun-style launch scripts export: `NNODES` (N or N:M), `NODE_RANK`,
   `MASTER_ADDR`, `MASTER_PORT`;
3. SLURM's: `SLURM_NNODES`, `SLURM_NODEID`, and the first host of `SLURM_JOB_NODELIST` as the
   endpoint (expanded with python-hostlist, the maintained parser of SLURM's hostlist syntax),
   its port from `MASTER_PORT` or `DEFAULT_PORT`.

A single-node job needs none of it. The job secret (`load_secret`) keys the control channel's
HMAC: from a file that only its owner can read (`--secret-file`), or from `UNBROKEN_JOB_SECRET`;
never from the command line, where every user of the host can read it in /proc. Pure: reads only
the mapping and the file it is given.
"""

from __future__ import annotations

import hashlib
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from unbroken.errors import UserError

__all__ = [
    "DEFAULT_PORT",
    "SECRET_ENV",
    "NodeJoin",
    "load_secret",
    "parse_endpoint",
    "parse_nnodes",
    "resolve_join",
    "secret_key",
]

DEFAULT_PORT = 29400
"""The control server's port when only a host is known (torchrun's rendezvous default)."""

SECRET_ENV = "UNBROKEN_JOB_SECRET"


@dataclass(frozen=True, slots=True)
class NodeJoin:
    """This node's place in a multi-node job."""

    nnodes: int
    node_rank: int
    host: str
    """The coordinator's address (node 0): its control server and the job store listen there."""
    port: int
    """The control server's port."""
    source: str
    """Where it came from: "command line", "environment" or "SLURM"."""
    spares: int = 0
    """Spare nodes that may join beyond the `nnodes` launched (`--nnodes N:M`: M - N)."""

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoint(text: str, what: str = "--rdzv-endpoint") -> tuple[str, int]:
    """ "HOST:PORT" (or "HOST", port `DEFAULT_PORT`; "[v6addr]:PORT" for IPv6).

    Raises:
        UserError: no host, or a port outside 1..65535.
    """
    host, sep, port = text.rpartition(":")
    if not sep or (host.count(":") and not host.startswith("[")):
        host, port = text, str(DEFAULT_PORT)  # no port, or a bare IPv6 address
    host = host.strip("[]")
    if not host:
        raise UserError(f"{what} {text!r}: give HOST:PORT, e.g. 10.0.0.1:{DEFAULT_PORT}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"{what} {text!r}: the port must be a number in 1..65535")
    return host, int(port)


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise UserError(f"{key}={env[key]!r}: not a whole number") from None


def parse_nnodes(text: str | int, what: str = "--nnodes") -> tuple[int, int]:
    """(nodes launched, spare nodes) from "N" or torchrun's elastic "N:M" (M >= N).

    Raises:
        UserError: not a count or a range of counts.
    """
    low, sep, high = str(text).partition(":")
    try:
        n, m = int(low), int(high) if sep else int(low)
    except ValueError:
        raise UserError(f"{what} {text!r}: give a node count N, or N:M to allow spares") from None
    if m < n:
        raise UserError(f"{what} {text!r}: M (nodes at most) is below N (nodes launched)")
    return n, m - n


def _master_port(env: Mapping[str, str]) -> int:
    """`MASTER_PORT`, else `DEFAULT_PORT` (torchrun-style and SLURM launches alike)."""
    return _int(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_PORT


def resolve_join(
    nnodes: int | str | None,
    node_rank: int | None,
    endpoint: str | None,
    env: Mapping[str, str],
) -> NodeJoin | None:
    """This node's `NodeJoin` from the command line's values (None where not given) or the
    environment; None for a single-node job (nothing says otherwise).

    Raises:
        UserError: a partial or contradictory description, named with its source.
    """
    given = {"--nnodes": nnodes, "--node-rank": node_rank, "--rdzv-endpoint": endpoint}
    if any(v is not None for v in given.values()):
        if nnodes is not None and parse_nnodes(nnodes) == (1, 0) and node_rank in (None, 0):
            return None
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise UserError(
                "a multi-node launch needs --nnodes, --node-rank and --rdzv-endpoint together; "
                f"missing {', '.join(missing)}"
            )
        host, port = parse_endpoint(str(endpoint))
        n, spares = parse_nnodes(str(nnodes))
        join = NodeJoin(n, int(str(node_rank)), host, port, "command line", spares)
        return _checked(join)
    if "NNODES" in env and "MASTER_ADDR" in env:
        port = _master_port(env)
        n, spares = parse_nnodes(env["NNODES"], "NNODES")
        join = NodeJoin(
            n,
            _int(env, "NODE_RANK") if "NODE_RANK" in env else 0,
            env["MASTER_ADDR"],
            port,
            "environment",
            spares,
        )
        return _checked(join) if join.nnodes + join.spares > 1 else None
    if "SLURM_NNODES" in env and "SLURM_JOB_NODELIST" in env:
        nnodes = _int(env, "SLURM_NNODES")
        if nnodes == 1:
            return None
        import hostlist

        try:
            hosts = hostlist.expand_hostlist(env["SLURM_JOB_NODELIST"])
        except hostlist.BadHostlist as exc:
            raise UserError(f"SLURM_JOB_NODELIST={env['SLURM_JOB_NODELIST']!r}: {exc}") from None
        port = _master_port(env)
        rank = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
        return _checked(NodeJoin(nnodes, rank, hosts[0], port, "SLURM"))
    return None


def _checked(join: NodeJoin) -> NodeJoin:
    if join.nnodes < 1:
        raise UserError(f"{join.source}: nnodes = {join.nnodes}; give at least 1")
    last = join.nnodes + join.spares - 1
    if not 0 <= join.node_rank <= last:
        raise UserError(f"{join.source}: node rank {join.node_rank} is not in 0..{last}")
    if not 0 < join.port < 65536:
        raise UserError(f"{join.source}: port {join.port} is not in 1..65535")
    return join


def secret_key(text: str) -> bytes:
    """The control channel's HMAC key for a job secret: SHA-256 of its text (any text works;
    docs/security.md says how to make a good one)."""
    return hashlib.sha256(text.strip().encode()).digest()


def load_secret(path: str | Path | None, env: Mapping[str, str]) -> str | None:
    """The job secret's text, from `path` or `UNBROKEN_JOB_SECRET`; None when neither is
    given.

    Raises:
        UserError: the file is missing, empty, or readable or writable by group or others.
    """
    if path is not None:
        p = Path(path)
        try:
            mode = p.stat().st_mode
            text = p.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"--secret-file {p}: cannot read it ({exc})") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise UserError(
                f"--secret-file {p}: readable by others (mode {stat.S_IMODE(mode):04o}); "
                f"chmod 600 {p}"
            )
        if not text:
            raise UserError(f"--secret-file {p}: empty")
        return text
    text = env.get(SECRET_ENV, "").strip()
    return text or None
