"""The tensor classes ``__tensor_unflatten__`` may build: torch_tp's own, registered by name.

``torch.compile`` takes a tensor subclass apart with ``__tensor_flatten__`` (inner tensors
plus a context) and rebuilds it with ``__tensor_unflatten__`` inside compiled graphs. The
context torch_tp writes names the concrete class; unflatten looks that name up here and
builds only a registered class. Classes register themselves when they are defined
(``__init_subclass__``), and only classes defined in ``torch_tp`` modules are accepted.
"""

from __future__ import annotations

__all__ = ["class_key", "register", "registered_class"]

_CLASSES: dict[str, type] = {}


def class_key(cls: type) -> str:
    """The registry name of ``cls``: ``module.QualName``."""
    return f"{cls.__module__}.{cls.__qualname__}"


def register(cls: type) -> type:
    """Allow ``__tensor_unflatten__`` to build ``cls`` (a class defined in a ``torch_tp`` module)."""
    if cls.__module__.split(".")[0] == "torch_tp":
        _CLASSES[class_key(cls)] = cls
    return cls


def registered_class(key: str, base: type) -> type:
    """The registered class named ``key``; ``TypeError`` unless it exists and subclasses ``base``."""
    cls = _CLASSES.get(key)
    if cls is None or not issubclass(cls, base):
        known = sorted(name for name, c in _CLASSES.items() if issubclass(c, base))
        raise TypeError(
            f"cannot rebuild a {base.__name__} of class {key!r} from a flattened tensor: "
            f"__tensor_unflatten__ only builds torch_tp's registered classes {known}. Tensor "
            f"subclasses defined outside torch_tp cannot pass through torch.compile this way"
        )
    return cls
