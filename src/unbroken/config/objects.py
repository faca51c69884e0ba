"""How the Python objects a caller gives `unbroken.run_job` (a model factory, a dataset) reach
the trainer processes.

[Note: user objects travel by reference]
Trainers are separate processes, and recovery starts more of them later: a restarted
generation, a shadow forked from the node's fork server, a job resumed from its
`config.json`. Each must rebuild the very same factory and dataset, or recovery is not
bit-exact. So a function or class travels *by reference*, as the `module:name` every process
imports (the config keys `model.factory` and `data.dataset` hold exactly that, and
`config.json` shows it):

- a top-level function or class of an importable module: `my_model:build`;
- one defined in the script being run (`__main__`): the script is imported by its file name
  from its folder, as `multiprocessing`'s spawn does — so the script must keep its
  `run_job(...)` call under `if __name__ == "__main__":` (a trainer that reaches an unguarded
  call stops with that fix named);
- `functools.partial(factory, key=value, ...)` for the model: the function by reference, the
  keywords (JSON values) into `model.factory_args`.

Lambdas, closures, nested functions and methods have no importable name and are refused with
one line naming the fix (define it with `def` at a module's top level). A dataset *object*
(an instance) travels by value: it is pickled with the standard `pickle` into
`OUT/objects/`, its class (and any function it holds) still by reference, and every trainer
unpickles the same bytes, so every process starts from the same state.

Why not cloudpickle: it would carry lambdas and closures by value, but as opaque bytes tied to
the Python version that wrote them, which `config.json` cannot show and a later resume may not
read; a name that is imported again is reproducible and reviewable. The cost is the rule above.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import os
import pickle
import sys
import sysconfig
import types
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from unbroken.errors import UserError

__all__ = [
    "ObjectRef",
    "factory_reference",
    "import_reference",
    "in_job_process",
    "pickle_dataset",
    "pickled_dataset",
    "reference",
]

_FIX = "define it with def at the top level of a module (trainers import it by module:name)"


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """An object as the trainer processes find it."""

    path: str
    """`module:name`, what `model.factory` / `data.dataset` hold."""
    search_dir: str | None
    """A folder trainers must put on sys.path to import the module (None: importable already)."""


def in_job_process() -> bool:
    """Whether this process belongs to a running job (an agent's child holds the job secret)."""
    return "UNBROKEN_JOB_SECRET" in os.environ


def _installed_dirs() -> set[str]:
    paths = sysconfig.get_paths()
    return {str(Path(paths[k]).resolve()) for k in ("stdlib", "platstdlib", "purelib", "platlib")}


def _root_dir(module_name: str, module_file: str | None) -> str | None:
    """The folder from which `module_name` imports (None when it is installed)."""
    if not module_file:
        return None
    root = Path(module_file).resolve().parent
    for _ in range(module_name.count(".") + (Path(module_file).stem == "__init__")):
        root = root.parent
    return None if str(root) in _installed_dirs() else str(root)


def _main_module_name(main: types.ModuleType, what: str, qualname: str) -> tuple[str, str]:
    """(module name, folder) under which trainers import the running script."""
    spec = getattr(main, "__spec__", None)
    file = getattr(main, "__file__", None)
    if spec is not None and spec.name and spec.name != "__main__":  # python -m package.module
        return spec.name, _root_dir(spec.name, file) or os.getcwd()
    if not file:
        raise UserError(
            f"{what}={qualname}: defined in an interactive session, which trainer processes "
            "cannot import; move it into a .py module and import it from there"
        )
    stem = Path(file).stem
    if not stem.isidentifier():
        raise UserError(
            f"{what}={qualname}: the script {file} cannot be imported by the trainers under "
            f"the name {stem!r}; rename the file to a valid module name or move {qualname} "
            "into a module"
        )
    return stem, str(Path(file).resolve().parent)


def reference(obj: Any, what: str) -> ObjectRef:
    """The importable name of a top-level function or class.

    Raises:
        UserError: `obj` has no importable name (a lambda, closure, method, nested class, an
            interactive definition), naming the fix.
    """
    qualname = getattr(obj, "__qualname__", None)
    module_name = getattr(obj, "__module__", None)
    if not isinstance(qualname, str) or not isinstance(module_name, str):
        raise UserError(f"{what}={obj!r}: not a function or class; {_FIX}")
    if getattr(obj, "__name__", None) == "<lambda>":
        raise UserError(f"{what}=<lambda>: a lambda cannot reach the trainer processes; {_FIX}")
    if "<locals>" in qualname or "." in qualname:
        raise UserError(
            f"{what}={qualname}: a nested function, closure or method cannot reach the trainer "
            f"processes; {_FIX}"
        )
    if module_name == "__main__":
        main = sys.modules["__main__"]
        if getattr(main, qualname, None) is not obj:
            raise UserError(f"{what}={qualname}: not a top-level name of the script; {_FIX}")
        name, folder = _main_module_name(main, what, qualname)
        return ObjectRef(f"{name}:{qualname}", folder)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(
            f"{what}={qualname}: its module {module_name!r} does not import ({exc})"
        ) from None
    if getattr(module, qualname, None) is not obj:
        raise UserError(
            f"{what}={qualname}: {module_name}.{qualname} is another object (redefined or "
            f"shadowed); {_FIX}"
        )
    return ObjectRef(f"{module_name}:{qualname}", _root_dir(module_name, module.__file__))


def factory_reference(obj: Any) -> tuple[ObjectRef, dict[str, Any]]:
    """A model factory (a function, a class, or `functools.partial` of one with keyword
    arguments) as its reference and the keyword arguments for `model.factory_args`.

    Raises:
        UserError: no importable name, positional arguments in a partial.
    """
    if isinstance(obj, partial):
        if obj.args:
            raise UserError(
                "model_factory=partial(...): positional arguments cannot go into "
                "model.factory_args; pass them by keyword"
            )
        return reference(obj.func, "model_factory"), dict(obj.keywords)
    return reference(obj, "model_factory"), {}


def import_reference(path: str, search_dir: str | None) -> Any:
    """Import `module:name` (with `search_dir` on sys.path): how a pickled dataset finds the
    script's classes and functions in a trainer."""
    if search_dir and search_dir not in sys.path:
        sys.path.insert(0, search_dir)
    module_name, _, name = path.partition(":")
    return getattr(importlib.import_module(module_name), name)


class _Pickler(pickle.Pickler):
    """Pickles the script's (`__main__`) classes and functions by the name trainers import."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.folders: set[str] = set()

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type | types.FunctionType) and obj.__module__ == "__main__":
            ref = reference(obj, "dataset")
            if ref.search_dir:
                self.folders.add(ref.search_dir)
            return import_reference, (ref.path, ref.search_dir)
        return NotImplemented


_LOADER = '''"""Written by unbroken.run_job: the dataset object it was given, unpickled from {blob}
(see unbroken.config.objects)."""

from unbroken.config.objects import pickled_dataset

dataset = pickled_dataset(__file__, "{blob}")
'''


def pickle_dataset(obj: Any, folder: Path) -> tuple[ObjectRef, list[str]]:
    """Pickle a dataset object into `folder` with a module that returns it to each trainer.

    Returns:
        its reference (for `data.dataset`) and the folders the trainers need on sys.path.

    Raises:
        UserError: the object cannot be pickled (it holds a lambda, an open file, ...).
    """
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    try:
        pickler.dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise UserError(
            f"dataset={type(obj).__name__}(...): cannot be pickled for the trainer processes "
            f"({exc}); pass its class instead, or keep only plain data in it"
        ) from None
    blob = buf.getvalue()
    digest = hashlib.sha256(blob).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"dataset-{digest}.pkl").write_bytes(blob)
    module = f"unbroken_dataset_{digest}"
    (folder / f"{module}.py").write_text(_LOADER.format(blob=f"dataset-{digest}.pkl"))
    folders = {str(folder.resolve())} | pickler.folders
    module_dir = _root_dir(
        type(obj).__module__, getattr(sys.modules.get(type(obj).__module__), "__file__", None)
    )
    if module_dir and type(obj).__module__ != "__main__":
        folders.add(module_dir)
    return ObjectRef(f"{module}:dataset", str(folder.resolve())), sorted(folders)


def pickled_dataset(module_file: str, blob: str) -> Callable[[Any, int], Any]:
    """The `data.dataset` callable of a pickled dataset object: `(data_cfg, n_shards)` -> the
    object, unpickled from `blob` beside `module_file` (a callable object is called with them)."""

    def dataset(data_cfg: Any, n_shards: int) -> Any:
        obj = pickle.loads((Path(module_file).parent / blob).read_bytes())
        if not hasattr(obj, "iteration") and callable(obj):
            return obj(data_cfg, n_shards)
        return obj

    return dataset
