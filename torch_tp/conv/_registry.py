"""The registry of ``torch_tp.conv``'s handler sets, the one way they enter DTensor, and when they apply.

DTensor dispatches an op to a *custom handler* when its table
(``DTensor._op_dispatcher._custom_op_handlers``, private in torch 2.13) maps the op to a
function, before any sharding propagation. Each handler module owns one :class:`HandlerSet`
(its ops, the module types it serves) and fills it with ``@HANDLERS.implements(op, ...)``, as
``torch_tp.quant``'s op tables do; creating a set registers it here (:func:`handler_sets`, in
import order: the one list of sets).

A set enters DTensor's table for one of two reasons, counted apart:

| reason | started by | ended by | where its handlers run |
| --- | --- | --- | --- |
| explicit | ``install()`` / the module's context manager | the matching ``uninstall()`` | every DTensor op |
| a spatial model | :func:`hold` (``SpatialParallel`` applied) | the model garbage-collected | inside a spatial model's forward and the backward through it |

DTensor's table holds one entry per op, a gate, while any set claiming the op is there; two
sets may claim one op, each for its calls (``when=``: ordinary and transposed convolution
share ``aten.convolution``). Outside those reasons, each entry behaves as the one it replaced: upstream's own handler (DTensor's
convolution halo handler) or DTensor's sharding propagation, results and errors alike. So a
spatial model living in a process changes nothing for the plain DTensor code beside it. A
handler that meets a layout it does not serve raises :class:`Decline` before communicating,
and DTensor's own path runs.

The scope: ``SpatialParallel``'s forward pre-hook :func:`enter_scope`, its forward hook (run
also on exceptions) :func:`exit_scope`; :func:`scope_backward` makes the backward reaching
the model's outputs enter the scope until that backward pass ends (autograd's final callback).
The scope is the process's, not one model's: a plain DTensor op whose backward runs in the
same backward pass after a spatial model's (a DTensor convolution feeding the model) runs
through the held sets' handlers in that pass.

Example:
    >>> from torch_tp.conv import _registry
    >>> sorted(s.owner.rsplit(".", 1)[1] for s in _registry.handler_sets())[:3]
    ['batch_norm', 'global_mean', 'group_norm']
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

__all__ = [
    "Decline",
    "HandlerSet",
    "enter_scope",
    "exit_scope",
    "handler_sets",
    "handles",
    "hold",
    "public_functions",
    "scope_active",
    "scope_backward",
    "sets_for",
]

_MISSING = object()
_SETS: list["HandlerSet"] = []
_PRESENT: list["HandlerSet"] = []  # the sets in DTensor's table now, in the order they entered
_GATES: dict[Any, "_Gate"] = {}  # op -> the entry in DTensor's table, while a set claiming it is there
_ACTIVE = 0  # spatial forwards and backward passes in flight


def _dtensor_handlers() -> dict:
    return DTensor._op_dispatcher._custom_op_handlers


class Decline(Exception):
    """Raised by a handler, before any communication, for a call it does not serve: the next
    claim of the op runs, else DTensor's own path (the entry the sets replaced)."""


class _Gate:
    """The entry the registry puts into DTensor's table for one op: the first claim that applies
    (its set present, in scope or installed explicitly, its ``when`` true), else the replaced
    entry's behaviour."""

    def __init__(self, op: Any, replaced: Any) -> None:
        self.op, self.replaced = op, replaced

    def handlers(self) -> list[Callable[..., Any]]:
        """The handlers of the sets in the table that claim the op."""
        return [handler_set.handlers[self.op] for handler_set in _PRESENT if self.op in handler_set.handlers]

    def __call__(self, op_call: Any, args: tuple, kwargs: dict) -> Any:
        scoped = _ACTIVE > 0
        for handler_set in list(_PRESENT):
            if self.op not in handler_set.handlers or not (scoped or handler_set.runs_everywhere()):
                continue
            when = handler_set.whens.get(self.op)
            if when is not None and not when(args, kwargs or {}):
                continue
            try:
                return handler_set.handlers[self.op](op_call, args, kwargs)
            except Decline:
                continue
        return self._replaced(op_call, args, kwargs)

    def _replaced(self, op_call: Any, args: tuple, kwargs: dict) -> Any:
        if self.replaced is not _MISSING:
            return self.replaced(op_call, args, kwargs)
        table = _dtensor_handlers()
        table.pop(self.op, None)  # DTensor's sharding propagation, for this one call
        try:
            return op_call(*args, **(kwargs or {}))
        finally:
            if _GATES.get(self.op) is self:  # not if the last set left the table meanwhile (a model collected)
                table[self.op] = self


class HandlerSet:
    """The DTensor handlers of one ``torch_tp.conv`` module, put into DTensor's table and taken out as a unit.

    Args:
        owner: the public module that owns the set (named in errors), e.g. ``"torch_tp.conv.pooling"``.
        serves: the layer types whose ``SpatialParallel`` needs the set (a whole-model region
            needs every set).

    Example:
        >>> import torch
        >>> op = torch.ops.aten.hardtanh_backward.default
        >>> example = HandlerSet("example", register=False)
        >>> @example.implements(op)
        ... def hardtanh_backward_handler(op_call, args, kwargs):
        ...     return None
        >>> with example.installed():
        ...     print(example.is_installed())
        True
        >>> example.is_installed()
        False
        >>> example.uninstall()
        Traceback (most recent call last):
        RuntimeError: example.uninstall() without a matching install()
    """

    def __init__(self, owner: str, *, serves: Iterable[type] = (), register: bool = True) -> None:
        self.owner = owner
        self.serves = tuple(serves)
        self.handlers: dict[Any, Callable[..., Any]] = {}
        self.whens: dict[Any, Callable[[tuple, dict], bool]] = {}  # op -> which of its calls the set takes
        self._explicit = 0  # outstanding install() calls
        self._holders = 0  # live spatial models that need the set
        if register:
            _SETS.append(self)

    def implements(self, *ops: Any, when: Callable[[tuple, dict], bool] | None = None
                   ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: ``handler(op_call, args, kwargs)`` serves each of ``ops`` (the calls for which
        ``when(args, kwargs)`` is true, when given: two sets may share an op, e.g. ordinary and
        transposed convolution)."""
        def register(handler: Callable[..., Any]) -> Callable[..., Any]:
            for op in ops:
                self.handlers[op] = handler
                if when is not None:
                    self.whens[op] = when
            return handler

        return register

    def present(self) -> bool:
        """Whether the set is in DTensor's table (installed explicitly, or held by a model)."""
        return self._explicit + self._holders > 0

    def runs_everywhere(self) -> bool:
        """Whether an explicit :meth:`install` is outstanding (the handlers run outside spatial models too)."""
        return self._explicit > 0

    # ---- the table
    def _enter_table(self) -> None:
        if self not in _PRESENT:
            _PRESENT.append(self)
        table = _dtensor_handlers()
        for op in self.handlers:
            if op not in _GATES:
                _GATES[op] = _Gate(op, table.get(op, _MISSING))
                table[op] = _GATES[op]

    def _leave_table(self) -> None:
        if self.present():
            return
        _PRESENT.remove(self)
        table = _dtensor_handlers()
        for op in self.handlers:
            if any(op in handler_set.handlers for handler_set in _PRESENT):
                continue  # another set in the table still claims it
            gate = _GATES.pop(op)
            if table.get(op) is gate:
                if gate.replaced is _MISSING:
                    table.pop(op)
                else:
                    table[op] = gate.replaced

    # ---- explicit installs
    def install(self) -> None:
        """Run the set's handlers for every DTensor op until the matching :meth:`uninstall` (nests)."""
        self._explicit += 1
        self._enter_table()

    def uninstall(self) -> None:
        """End the latest :meth:`install`; the replaced entries come back once nothing needs the set.

        Raises:
            RuntimeError: no :meth:`install` is outstanding.
        """
        if not self._explicit:
            raise RuntimeError(f"{self.owner}.uninstall() without a matching install()")
        self._explicit -= 1
        self._leave_table()

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """:meth:`install` on entry, :meth:`uninstall` on exit (also on exceptions)."""
        self.install()
        try:
            yield
        finally:
            self.uninstall()

    def is_installed(self) -> bool:
        """Whether the set is present and DTensor's table maps every op of it to the registry's entry now."""
        table = _dtensor_handlers()
        return self.present() and all(op in _GATES and table.get(op) is _GATES[op] for op in self.handlers)

    # ---- spatial models
    def _hold(self) -> None:
        self._holders += 1
        self._enter_table()

    def _release(self) -> None:
        self._holders -= 1
        self._leave_table()

    def public_functions(self, context_name: str, what: str) -> tuple[Callable[..., Any], ...]:
        """``(install, uninstall, is_installed, <context_name>)`` for the owning module, documented.

        Example:
            >>> import torch
            >>> example = HandlerSet("example", register=False)
            >>> install, uninstall, is_installed, handled = example.public_functions("handled", "example")
            >>> with handled():
            ...     print(is_installed(), handled.__name__)
            True handled
        """
        return public_functions((self,), self.owner, context_name, what)


def handler_sets() -> tuple[HandlerSet, ...]:
    """Every registered set, in import order (``torch_tp.conv`` imports every handler module).

    Example:
        >>> len(handler_sets()) >= 8
        True
    """
    return tuple(_SETS)


def handles(op: Any) -> bool:
    """Whether a set in DTensor's table now has a handler for ``op``.

    Example:
        >>> import torch
        >>> handles(torch.ops.aten.sort.default)
        False
    """
    return any(op in handler_set.handlers for handler_set in _PRESENT)


def sets_for(module: nn.Module | None) -> tuple[HandlerSet, ...]:
    """The sets a ``SpatialParallel`` layer ``module`` needs; every set for a region (``None``).

    Example:
        >>> import torch.nn as nn
        >>> sorted(s.owner for s in sets_for(nn.BatchNorm2d(4)))
        ['torch_tp.conv.batch_norm']
    """
    if module is None:
        return handler_sets()
    return tuple(s for s in _SETS if isinstance(module, s.serves))


def hold(model: nn.Module, sets: Iterable[HandlerSet]) -> None:
    """Keep ``sets`` in DTensor's table while ``model`` lives (released when it is garbage-collected).

    Example:
        >>> import gc, torch.nn as nn
        >>> conv = nn.Conv2d(3, 4, 3)
        >>> hold(conv, sets_for(conv))
        >>> from torch_tp.conv import sharded_conv
        >>> sharded_conv.is_installed()
        True
        >>> del conv; _ = gc.collect()
        >>> sharded_conv.is_installed()
        False
    """
    sets = tuple(sets)
    for handler_set in sets:
        handler_set._hold()
    weakref.finalize(model, _release, sets)


def _release(sets: tuple[HandlerSet, ...]) -> None:
    for handler_set in sets:
        handler_set._release()


# --------------------------------------------------------------------------------------------
# The scope: inside a spatial model's forward, and the backward passes through one
# --------------------------------------------------------------------------------------------


def scope_active() -> bool:
    """Whether a spatial model's forward, or a backward pass through one, is running.

    Example:
        >>> scope_active()
        False
    """
    return _ACTIVE > 0


def enter_scope(*_: Any) -> None:
    """Forward pre-hook of a spatial model: its ops run through the held sets' handlers.

    Example:
        >>> enter_scope(); print(scope_active()); exit_scope()
        True
    """
    global _ACTIVE
    _ACTIVE += 1


def exit_scope(*_: Any) -> None:
    """Forward hook (``always_call=True``) of a spatial model: the scope it entered ends.

    Example:
        >>> enter_scope(); exit_scope(); scope_active()
        False
    """
    global _ACTIVE
    _ACTIVE = max(_ACTIVE - 1, 0)


def _enter_for_this_backward(grad: Any) -> Any:
    enter_scope()
    torch.autograd.Variable._execution_engine.queue_callback(exit_scope)
    return grad


def scope_backward(output: Any) -> None:
    """Make the backward pass that reaches ``output`` (a tensor, or tensors in a tuple, list or
    dict) run in the scope from there until it ends.

    Example:
        >>> import torch
        >>> x = torch.ones(2, requires_grad=True)
        >>> y = x * 2
        >>> scope_backward(y)
        >>> y.sum().backward(); scope_active()
        False
    """
    if isinstance(output, torch.Tensor):
        if output.requires_grad:
            output.register_hook(_enter_for_this_backward)
    elif isinstance(output, (tuple, list)):
        for item in output:
            scope_backward(item)
    elif isinstance(output, dict):
        for item in output.values():
            scope_backward(item)


# --------------------------------------------------------------------------------------------
# The four public functions of each handler module
# --------------------------------------------------------------------------------------------


def public_functions(sets: tuple[HandlerSet, ...], owner: str, context_name: str,
                     what: str) -> tuple[Callable[..., Any], ...]:
    """``(install, uninstall, is_installed, <context_name>)`` over ``sets``, documented for ``owner``.

    Example:
        >>> example = HandlerSet("example", register=False)
        >>> install, uninstall, is_installed, handled = public_functions((example,), "example", "handled", "x")
        >>> handled.__name__, install.__module__
        ('handled', 'example')
    """
    def install() -> None:
        for handler_set in sets:
            handler_set.install()

    def uninstall() -> None:
        for handler_set in sets:
            handler_set.uninstall()

    def is_installed() -> bool:
        return all(handler_set.is_installed() for handler_set in sets)

    @contextlib.contextmanager
    def installed() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for handler_set in sets:
                stack.enter_context(handler_set.installed())
            yield

    docs = {
        install: f"""Put the {what} handlers into DTensor's custom op handler table, for every DTensor op.

        (``SpatialParallel`` needs no call: a spatial model holds the sets it needs while it lives,
        and their handlers run inside it only.) Nests: the matching :func:`uninstall` ends this
        call; the replaced entries come back once nothing needs the handlers.

        Example::

            >>> from {owner} import install, is_installed, uninstall
            >>> install(); is_installed()
            True
            >>> uninstall(); is_installed()
            False
        """,
        uninstall: f"""End the latest :func:`install`.

        Raises:
            RuntimeError: no :func:`install` is outstanding.

        Example::

            >>> from {owner} import uninstall
            >>> uninstall()
            Traceback (most recent call last):
            RuntimeError: {owner}.uninstall() without a matching install()
        """,
        is_installed: f"""Whether DTensor's table maps every {what} op to these handlers now.

        Example::

            >>> from {owner} import is_installed, {context_name}
            >>> with {context_name}():
            ...     print(is_installed())
            True
        """,
        installed: f"""Context manager: :func:`install` on entry, :func:`uninstall` on exit (also on exceptions).

        Example::

            >>> from {owner} import is_installed, {context_name}
            >>> with {context_name}():
            ...     pass
            >>> is_installed()
            False
        """,
    }
    for function, doc in docs.items():
        function.__doc__ = doc
        function.__module__ = owner
    installed.__name__ = installed.__qualname__ = context_name
    for function in (install, uninstall, is_installed):
        function.__qualname__ = function.__name__
    return install, uninstall, is_installed, installed
