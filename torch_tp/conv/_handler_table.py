"""A set of DTensor custom op handlers put in place and taken out as one unit.

DTensor dispatches an op to a *custom handler* when its table
(``DTensor._op_dispatcher._custom_op_handlers``, private in torch 2.13) maps the op to a
function, before any sharding propagation. Each ``torch_tp.conv`` module (convolution,
batch norm, group norm, pooling, upsampling) owns one :class:`HandlerTable` and exposes it as
``install`` / ``uninstall`` / ``is_installed`` and a context manager. Installs nest: each
:meth:`HandlerTable.install` remembers the entries it replaced, and the matching
:meth:`HandlerTable.uninstall` puts back exactly those objects (or removes the op again).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from torch.distributed.tensor import DTensor

__all__ = ["HandlerTable"]

_MISSING = object()


def _dtensor_handlers() -> dict:
    return DTensor._op_dispatcher._custom_op_handlers


class HandlerTable:
    """The handlers of one module, installed into DTensor's table and removed as a unit.

    Args:
        owner: the public module that owns the table (named in errors), e.g.
            ``"torch_tp.conv.pooling"``.
        handlers: ``{aten op overload: handler(op_call, args, kwargs)}``.

    Example:
        >>> import torch
        >>> op = torch.ops.aten.hardtanh_backward.default
        >>> table = HandlerTable("example", {op: lambda op_call, args, kwargs: None})
        >>> with table.installed():
        ...     print(table.is_installed())
        True
        >>> table.is_installed()
        False
        >>> table.uninstall()
        Traceback (most recent call last):
        RuntimeError: example.uninstall() without a matching install()
    """

    def __init__(self, owner: str, handlers: dict[Any, Callable[..., Any]]) -> None:
        self.owner = owner
        self.handlers = dict(handlers)
        self._saved: list[dict] = []  # one entry per install(): the table entries it replaced

    def install(self) -> None:
        """Map every op to its handler, remembering what each entry held before."""
        table = _dtensor_handlers()
        self._saved.append({op: table.get(op, _MISSING) for op in self.handlers})
        table.update(self.handlers)

    def uninstall(self) -> None:
        """Put back the entries the latest :meth:`install` replaced.

        Raises:
            RuntimeError: no :meth:`install` is outstanding.
        """
        if not self._saved:
            raise RuntimeError(f"{self.owner}.uninstall() without a matching install()")
        table = _dtensor_handlers()
        for op, previous in self._saved.pop().items():
            if previous is _MISSING:
                table.pop(op, None)
            else:
                table[op] = previous

    def is_installed(self) -> bool:
        """Whether DTensor's table maps every op to this table's handler now."""
        table = _dtensor_handlers()
        return all(table.get(op) is handler for op, handler in self.handlers.items())

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """:meth:`install` on entry, :meth:`uninstall` on exit (also on exceptions)."""
        self.install()
        try:
            yield
        finally:
            self.uninstall()

    def public_functions(self, context_name: str, what: str) -> tuple[Callable[..., Any], ...]:
        """``(install, uninstall, is_installed, <context_name>)`` for the owning module, documented:
        each ``torch_tp.conv`` module exposes its table through these four, defined in one line.

        Example:
            >>> import torch
            >>> op = torch.ops.aten.hardtanh_backward.default
            >>> table = HandlerTable("example", {op: lambda op_call, args, kwargs: None})
            >>> install, uninstall, is_installed, handled = table.public_functions("handled", "example")
            >>> with handled():
            ...     print(is_installed(), handled.__name__)
            True handled
        """
        owner = self.owner

        def install() -> None:
            self.install()

        def uninstall() -> None:
            self.uninstall()

        def is_installed() -> bool:
            return self.is_installed()

        @contextlib.contextmanager
        def installed() -> Iterator[None]:
            with self.installed():
                yield

        docs = {
            install: f"""Put the {what} handlers into DTensor's custom op handler table.

            Nests: each :func:`install` remembers the entries it replaced, and the matching
            :func:`uninstall` puts exactly those back (in torch 2.13: none, removed).

            Example::

                >>> from {owner} import install, is_installed, uninstall
                >>> install(); is_installed()
                True
                >>> uninstall(); is_installed()
                False
            """,
            uninstall: f"""Restore the entries the latest :func:`install` replaced.

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

