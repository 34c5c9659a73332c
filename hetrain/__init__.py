"""hetrain: train large models on mixed, preemptible GPUs.

From Python (each also a command; see ``hetrain.api`` for the whole story)::

    import hetrain

    result = hetrain.plan("cluster.yaml", "model.yaml", global_batch_size=64)   # .plan, .estimate
    records = hetrain.train(result.plan, "runs/first", steps=100, data="corpus.bin")
    hetrain.export("runs/first", "exported/")

``load_cluster``, ``load_model``, ``load_plan``, ``load_profile``, ``check_plan``,
``prepare_data``, ``load_export`` and ``build_model`` complete it; ``TrainOptions`` holds
every option of ``train`` and ``HetrainError`` is what a bad input raises. They load on first
use: ``import hetrain`` imports neither torch nor the planner.

Two of the functions share their names with parts of the library: ``hetrain.plan`` is also
the package of the plan file (``hetrain.plan.schema``) and ``hetrain.export`` the export
module. Both are those modules, made callable: ``hetrain.plan(...)`` calls ``hetrain.api.plan``
and ``hetrain.export(...)`` ``hetrain.api.export``, and every import of the modules works as
ever (``import hetrain.plan.schema as schema``).

Data flows one way, one subpackage per stage: ``spec`` -> ``profiling`` -> plan (``solver``
writes ``hetrain.plan/v1``, ``plan``) -> ``runtime`` -> ``checkpoint`` -> ``recovery`` -> new
plan; ``cost`` predicts for all of them and ``config`` is the run's file. This package never
imports Prefect; only ``cli`` and ``api`` (the application layers) import the planners
(.importlinter checks both).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it (imported when the name is first used); plan and export
# are the modules of those names, callable (_CallableModule below)
_LAZY = {
    "plan": "hetrain", "export": "hetrain",
    **{name: "hetrain.api" for name in ("train", "load_cluster", "load_model", "load_plan", "load_profile",
                                        "check_plan", "prepare_data", "load_export", "build_model")},
    "TrainOptions": "hetrain.config",
    "HetrainError": "hetrain.errors",
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports on demand
    from hetrain.api import (build_model, check_plan, export, load_cluster, load_export, load_model, load_plan,
                             load_profile, plan, prepare_data, train)
    from hetrain.config import TrainOptions
    from hetrain.errors import HetrainError


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hetrain' has no attribute '{name}'")
    if module == __name__:  # plan, export: importing the submodule binds it here, callable
        return importlib.import_module(f"{__name__}.{name}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


_CALLABLE_MODULES = frozenset({"plan", "export"})


class _CallableModule(types.ModuleType):
    """A library module that is also the API function of its name (``hetrain.plan(...)``)."""

    def _function(self) -> Any:
        from hetrain import api

        return getattr(api, self.__name__.rpartition(".")[2])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._function()(*args, **kwargs)

    @property
    def __signature__(self) -> Any:  # inspect.signature(hetrain.plan), a notebook's call tip: the function's
        import inspect

        return inspect.signature(self._function())


class _Package(types.ModuleType):
    """hetrain's module object: the submodules ``plan`` and ``export`` become callable when bound.

    The import system binds every loaded submodule on its parent package (``import
    hetrain.plan.schema`` sets ``hetrain.plan``); the binding of these two turns the module
    into a ``_CallableModule``, so the name is the module and the function at once, whichever
    was used first.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _CALLABLE_MODULES and type(value) is types.ModuleType:
            value.__class__ = _CallableModule
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
