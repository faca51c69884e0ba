"""The import-layer contract of `unbroken` and the rule of no import cycles between modules.

Both are checked on the import graph that import-linter builds (`grimp`), which sees every
import: at module level, inside functions and under `TYPE_CHECKING`. The layers run from the
top (may import everything below) to the bottom (imports nothing of `unbroken`); packages in
one tuple are independent siblings (neither imports the other). Where each package sits and
why is in the comments of `LAYERS`. A new package of `unbroken` must be placed here.

Run `python tests/test_import_layers.py` to print the package-level import edges.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from dataclasses import dataclass

import grimp
import pytest

ROOT = "unbroken"

LAYERS: tuple[str | tuple[str, ...], ...] = (
    "cli",  # the command line: parses arguments, calls api and bench
    # Adapters of other libraries' models (Hugging Face transformers) to the own-model
    # contract; named by a job's `model.factory`, imported by nothing of unbroken.
    "integrations",
    "bench",  # benchmark harnesses: may run whole jobs (api) or drive any library part
    "api",  # run_job: a job config to a finished run directory
    # Checks of a job before launch, in the CLI process: calls the engine's, the model's and
    # inject's own checks on the meta-device model; launches nothing.
    "preflight",
    "launch",  # processes of a job: coordinator, agents, trainers, restore
    "recovery",  # what to do after a failure; launch executes it
    # Fault injection: imported by launch's trainers and by api; it fires faults at a
    # (rank, iteration, phase) of train, reads detect's slow levels and damages checkpoints.
    "inject",
    # The runtimes of one rank and the planner. plan (the ResiHP scheduler, issue 15) reads
    # parallel's plan IR and may use what detect reports; it never drives a runtime.
    ("engine", "shadow", "plan"),
    # detect reads the plan IR and train's phases; update runs train's optimizer step on
    # retained state; checkpoint saves and loads train's state.
    ("detect", "update", "checkpoint"),
    # The plan IR (torch-free), and the training loop's parts (state, optimizer, phases, loop)
    # that engine, detect, update, checkpoint and inject all build on.
    ("parallel", "train"),
    # Leaves: the event log (metrics; detect's sink writes through it), retained memory,
    # erasure codes, the reference models and the cluster simulator (imports config only).
    ("metrics", "state", "erasure", "model", "sim"),
    "data",  # corpus, packing, sampler; the models take their batches
    "config",  # typed job configs
    # The typed messages between processes, the typed job store and the devices' health
    # registry (written by the injector, read by the agent): everything that crosses
    # a process boundary (launch, shadow's reclamation client, inject's fired faults,
    # checkpoint's shared decisions) speaks them; they import nothing of unbroken.
    ("messages", "jobstore", "devices"),
    # Builds the package's C sources on first use (erasure's CPU kernel, update's lending
    # allocator); imports nothing of unbroken.
    "native",
    "errors",  # UserError, imported everywhere
)


@dataclass(frozen=True, slots=True)
class KnownViolation:
    importer: str
    imported: str
    where: str
    why: str


# [Note: known import violations] Imports allowed to break the contract: none. The
# orchestration redesign (issue 14) removed the three it found (train/build importing update,
# the run summary importing inject, the launch.restore <-> launch.retained cycle). Never add an
# entry for new code; an entry whose import is gone fails `test_known_violations_still_exist`.
KNOWN_VIOLATIONS: tuple[KnownViolation, ...] = ()


def _graph(*, known_removed: bool = True) -> grimp.ImportGraph:
    graph = grimp.build_graph(ROOT, cache_dir=None)
    if known_removed:
        for v in KNOWN_VIOLATIONS:
            graph.remove_import(importer=v.importer, imported=v.imported)
    return graph


def _layer_names() -> list[str]:
    return [n for layer in LAYERS for n in ((layer,) if isinstance(layer, str) else layer)]


def _describe(dep) -> str:
    lines = [f"{dep.importer} imports {dep.imported} (a higher layer):"]
    for route in sorted(dep.routes, key=lambda r: (sorted(r.heads), r.middle)):
        chain = [
            "|".join(sorted(route.heads)),
            *route.middle,
            "|".join(sorted(route.tails)),
        ]
        lines.append("    " + " -> ".join(chain))
    return "\n".join(lines)


def test_every_package_has_a_layer():
    graph = _graph()
    packages = {m.split(".")[1] for m in graph.modules if m.count(".") >= 1}
    unplaced = sorted(packages - set(_layer_names()) - {"__main__"})
    assert not unplaced, f"place these packages in LAYERS (tests/test_import_layers.py): {unplaced}"


def test_packages_import_only_lower_layers():
    layers = [
        layer if isinstance(layer, str) else grimp.Layer(*layer, independent=True)
        for layer in LAYERS
    ]
    illegal = _graph().find_illegal_dependencies_for_layers(layers=layers, containers={ROOT})
    report = "\n".join(sorted(_describe(d) for d in illegal))
    assert not illegal, f"imports against the layers of tests/test_import_layers.py:\n{report}"


def test_no_import_cycles_between_modules():
    cycles = _cycles(_graph())
    report = "\n".join(" <-> ".join(c) for c in cycles)
    assert not cycles, f"import cycles between modules:\n{report}"


def test_known_violations_still_exist():
    graph = _graph(known_removed=False)
    gone = [
        f"{v.importer} -> {v.imported} ({v.where})"
        for v in KNOWN_VIOLATIONS
        if not graph.direct_import_exists(importer=v.importer, imported=v.imported)
    ]
    assert not gone, f"these imports are gone; delete them from KNOWN_VIOLATIONS: {gone}"


def test_the_cycle_check_finds_a_cycle():
    graph = grimp.ImportGraph()
    for a, b in (("x.a", "x.b"), ("x.b", "x.c"), ("x.c", "x.a"), ("x.c", "x.d")):
        graph.add_import(importer=a, imported=b)
    assert _cycles(graph) == [["x.a", "x.b", "x.c"]]


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = itertools.count()
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = next(counter)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = next(counter)
                    stack.append(child)
                    on_stack.add(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child))))
                    )
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _package_edges() -> list[str]:
    graph = _graph(known_removed=False)
    edges: dict[tuple[str, str], list[str]] = {}
    for importer in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(importer):
            a, b = importer.split(".")[1:2], imported.split(".")[1:2]
            if a and b and a != b:
                for d in graph.get_import_details(importer=importer, imported=imported):
                    where = f"{importer}:{d['line_number']}"
                    edges.setdefault((a[0], b[0]), []).append(where)
    return [f"{a} -> {b}: {', '.join(sorted(w))}" for (a, b), w in sorted(edges.items())]


if __name__ == "__main__":
    print("\n".join(_package_edges()))
    sys.exit(0)


@pytest.mark.parametrize(
    "module", ["unbroken.launch.agent.loop", "unbroken.state.manager", "unbroken.cli.main"]
)
def test_processes_that_never_train_do_not_import_torch(module):
    """The agent and the state managers start with every job (and the CLI with every command):
    torch's import, seconds on a loaded machine, would delay each start."""
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, f"{module} imports torch" + (done.stderr and f": {done.stderr}")
