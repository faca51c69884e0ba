"""Where a node finds its job: the command line, torchrun-style variables and SLURM's, in that
order; the job secret from a private file or the environment; the node layout as data."""

from __future__ import annotations

import os

import pytest

from unbroken.config import JobConfig, NodesConfig, ParallelConfig
from unbroken.errors import UserError
from unbroken.launch.coordinator.nodes import NodeLayout
from unbroken.launch.rendezvous import (
    DEFAULT_PORT,
    NodeJoin,
    load_secret,
    parse_endpoint,
    parse_nnodes,
    resolve_join,
    secret_key,
)

SLURM = {"SLURM_NNODES": "3", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[07-09]"}
TORCHRUN = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "6000"}


def test_the_command_line_wins_over_the_environment():
    join = resolve_join(2, 1, "10.1.1.1:7000", {**SLURM, **TORCHRUN})
    assert join == NodeJoin(2, 1, "10.1.1.1", 7000, "command line")


def test_torchrun_style_variables_then_slurm():
    assert resolve_join(None, None, None, {**SLURM, **TORCHRUN}) == NodeJoin(
        2, 1, "10.0.0.5", 6000, "environment"
    )
    assert resolve_join(None, None, None, SLURM) == NodeJoin(3, 2, "gpu07", DEFAULT_PORT, "SLURM")
    with_port = resolve_join(None, None, None, {**SLURM, "MASTER_PORT": "6001"})
    assert with_port is not None and with_port.endpoint == "gpu07:6001"


def test_torchruns_elastic_node_range_allows_spare_nodes():
    # --nnodes N:M launches N nodes; node ranks N..M-1 are spares that may join.
    spare = resolve_join("2:3", 2, "10.1.1.1:7000", {})
    assert spare == NodeJoin(2, 2, "10.1.1.1", 7000, "command line", spares=1)
    env = {**TORCHRUN, "NNODES": "2:4", "NODE_RANK": "3"}
    assert resolve_join(None, None, None, env) == NodeJoin(
        2, 3, "10.0.0.5", 6000, "environment", spares=2
    )
    assert parse_nnodes("4") == (4, 0) and parse_nnodes("1:2") == (1, 1)
    # One node with a spare is a multi-node job; one node alone is not.
    assert resolve_join("1:2", 0, "h:1", {}) is not None
    assert resolve_join("1", None, None, {}) is None


def test_one_node_needs_nothing():
    assert resolve_join(None, None, None, {}) is None
    assert resolve_join(1, None, None, {}) is None
    assert resolve_join(None, None, None, {**SLURM, "SLURM_NNODES": "1"}) is None


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        ((2, None, "h:1"), {}, "missing --node-rank"),
        ((2, 2, "h:1"), {}, "node rank 2 is not in 0..1"),
        ((2, 0, "h:99999"), {}, "1..65535"),
        ((2, 0, ":80"), {}, "give HOST:PORT"),
        (("2:3", 3, "h:1"), {}, "node rank 3 is not in 0..2"),
        (("3:2", 0, "h:1"), {}, "M (nodes at most) is below N"),
        (("two", 0, "h:1"), {}, "give a node count N, or N:M"),
        ((None, None, None), {**TORCHRUN, "NNODES": "2:x"}, "NNODES '2:x'"),
        ((None, None, None), {**TORCHRUN, "NODE_RANK": "x"}, "NODE_RANK='x'"),
        ((None, None, None), {**SLURM, "SLURM_JOB_NODELIST": "gpu[09-"}, "SLURM_JOB_NODELIST"),
    ],
)
def test_a_bad_description_is_one_line_naming_its_source(args, env, says):
    with pytest.raises(UserError) as err:
        resolve_join(*args, env)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_endpoints_with_and_without_a_port():
    assert parse_endpoint("node0") == ("node0", DEFAULT_PORT)
    assert parse_endpoint("[fd00::1]:5000") == ("fd00::1", 5000)
    assert parse_endpoint("fd00::1") == ("fd00::1", DEFAULT_PORT)


def test_the_secret_comes_from_a_private_file_or_the_environment(tmp_path):
    path = tmp_path / "job.secret"
    path.write_text("  abc123\n")
    os.chmod(path, 0o644)
    with pytest.raises(UserError, match=r"readable by others \(mode 0644\); chmod 600"):
        load_secret(path, {})
    os.chmod(path, 0o600)
    assert load_secret(path, {"UNBROKEN_JOB_SECRET": "other"}) == "abc123"
    assert load_secret(None, {"UNBROKEN_JOB_SECRET": "other"}) == "other"
    assert load_secret(None, {}) is None
    with pytest.raises(UserError, match="cannot read"):
        load_secret(tmp_path / "missing", {})
    assert secret_key("abc123") == secret_key(" abc123\n") != secret_key("abc124")


def test_node_layouts_even_and_after_a_loss():
    layout = NodeLayout.even(2, 2)
    assert [n.ranks for n in layout.nodes] == [(0, 1), (2, 3)]
    assert layout.node_of(3) == 1
    # devices 2 and 3 (node 1) lost: the survivors are ranks 0, 1 of node 0 alone
    after = NodeLayout.for_devices((0, 1), {0: 0, 1: 0, 2: 1, 3: 1})
    assert after.node_ids == (0,) and after.ranks_of(0) == (0, 1)
    # one device lost on each node: ranks renumbered in device order, each on its node
    mixed = NodeLayout.for_devices((1, 2), {0: 0, 1: 0, 2: 1, 3: 1})
    assert [(n.node, n.ranks) for n in mixed.nodes] == [(0, (0,)), (1, (1,))]


def test_the_nodes_must_hold_the_world():
    cfg = JobConfig(parallel=ParallelConfig(world_size=4), nodes=NodesConfig(count=2))
    assert cfg.nodes.per_node(4) == 2
    with pytest.raises(ValueError, match="count × ranks_per_node = world_size"):
        JobConfig(parallel=ParallelConfig(world_size=4), nodes=NodesConfig(count=3))
    with pytest.raises(ValueError, match="count × ranks_per_node"):
        JobConfig(
            parallel=ParallelConfig(world_size=4),
            nodes=NodesConfig(count=2, ranks_per_node=3),
        )
