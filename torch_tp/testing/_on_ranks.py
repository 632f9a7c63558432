"""``@on_ranks``: a pytest test whose body runs on every rank of a worker pool.

It replaces the two-part pattern of a module-level rank function plus a test that only
forwards it to :func:`~torch_tp.testing.run_on_ranks`::

    def _case(): ...                      # module level, runs on every rank
    @world_sizes(2, 4)
    def test_x(world_size):
        run_on_ranks(_case, world_size)

with one decorated function. Workers import the rank function by reference, so the
decorator keeps the body importable under a private module-level name
(``_test_x_on_ranks``) while ``test_x`` becomes the pytest test that sends it to the pool.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable

from torch_tp.testing._dist import DEFAULT_TASK_TIMEOUT, _check_world_size, run_on_ranks, world_sizes

__all__ = ["on_ranks"]

_WORLD_SIZE = "world_size"


def on_ranks(*sizes: int, timeout: float = DEFAULT_TASK_TIMEOUT) -> Callable[[Callable[..., Any]], Callable[..., None]]:
    """Run the decorated module-level test's body on every rank of a pool of each size.

    The test is parametrized over ``world_size`` with ids ``ws<N>`` exactly like
    :func:`world_sizes`, one size included (so ``-k ws2`` selects). The body's own arguments
    (``pytest.mark.parametrize`` values, fixtures such as ``tmp_path``) are sent to every
    rank, so they must pickle; a body that declares ``world_size`` receives it too. Inside,
    use the rank-side helpers (:func:`rank`, :func:`tp_mesh`, ...) and assert there: a
    failing rank fails the test with :class:`RankFailure` (the rank's traceback and output),
    as :func:`run_on_ranks` does. The test returns nothing, and a body that returns a value
    is an error (compare per-rank results in the parent with :func:`run_on_ranks`).

    ``timeout`` (seconds) bounds each pool call, as in :func:`run_on_ranks`.

    Example::

        >>> @on_ranks(2, 4)
        ... def test_all_reduce_sums_ranks():
        ...     t = torch.tensor([float(rank())])
        ...     dist.all_reduce(t)
        ...     assert t.item() == sum(range(world_size()))
        >>> [(m.args, m.kwargs["ids"]) for m in test_all_reduce_sums_ranks.pytestmark]
        [(('world_size', (2, 4)), ['ws2', 'ws4'])]
    """
    if not sizes:
        raise ValueError("on_ranks needs at least one world size, e.g. @on_ranks(2) or @on_ranks(2, 4)")
    for size in sizes:
        _check_world_size(size)

    def decorate(body: Callable[..., Any]) -> Callable[..., None]:
        _require_module_level_function(body)
        test = _pytest_test(body, timeout)
        _register_rank_body(body)
        return world_sizes(*sizes)(test)

    return decorate


def _require_module_level_function(body: Any) -> None:
    if not inspect.isfunction(body):
        raise TypeError(f"on_ranks decorates a test function, got {body!r}")
    if body.__qualname__ != body.__name__:
        raise TypeError(
            f"on_ranks needs a module-level test function (workers import it by name), but "
            f"{body.__qualname__!r} is nested in a function or class; move it to module scope"
        )
    awkward = [p.name for p in _parameters(body) if p.kind is not p.POSITIONAL_OR_KEYWORD]
    if awkward:
        raise TypeError(
            f"on_ranks: {body.__name__} has *args, **kwargs or keyword-only parameters {awkward}; "
            f"declare plain parameters (fixtures and parametrized arguments)"
        )


def _parameters(body: Callable[..., Any]) -> list[inspect.Parameter]:
    return list(inspect.signature(body).parameters.values())


def _pytest_test(body: Callable[..., Any], timeout: float) -> Callable[..., None]:
    """The function pytest collects: takes the body's arguments (and ``world_size``), sends the body."""
    body_parameters = _parameters(body)

    @functools.wraps(body)
    def test(**arguments: Any) -> None:
        __tracebackhide__ = True
        args = [arguments[p.name] if p.name in arguments else p.default for p in body_parameters]
        results = run_on_ranks(body, arguments[_WORLD_SIZE], *args, timeout=timeout)
        _require_no_results(body, results)

    world_size = inspect.Parameter(_WORLD_SIZE, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    test_parameters = [world_size] + [p for p in body_parameters if p.name != _WORLD_SIZE]
    test.__signature__ = inspect.Signature(test_parameters)  # what pytest reads, not __wrapped__'s
    return test


def _register_rank_body(body: Callable[..., Any]) -> None:
    """Bind ``body`` to ``_<name>_on_ranks`` in its module, so pickle finds it by that name."""
    name = f"_{body.__name__}_on_ranks"
    module_globals = _namespace_of(body)
    if module_globals.get(name, body) is not body:
        raise ValueError(
            f"on_ranks keeps the body of {body.__name__} as {body.__module__}.{name}, but that "
            f"name is already taken; rename one of them"
        )
    module_globals[name] = body
    body.__name__ = body.__qualname__ = name


def _namespace_of(body: Callable[..., Any]) -> dict[str, Any]:
    """The namespace of the module ``body`` names as its own, where pickle looks it up."""
    if body.__globals__.get("__name__") == body.__module__:
        return body.__globals__  # defined there (or in a doctest's namespace)
    return vars(sys.modules[body.__module__])  # wrapped by a decorator defined in another module


def _require_no_results(body: Callable[..., Any], results: list[Any]) -> None:
    returned = {r: value for r, value in enumerate(results) if value is not None}
    if returned:
        raise TypeError(
            f"{body.__module__}.{body.__qualname__} returned values {returned} (by rank); a test "
            f"decorated with on_ranks asserts inside its body and returns nothing. To compare "
            f"per-rank results in the parent, call run_on_ranks(fn, world_size) instead"
        )
