"""Integrations with other libraries' models, each imported only when used.

- :mod:`torch_tp.integrations.transformers`: Hugging Face transformers models, parallelized
  from the plans they carry.

Example::

    >>> # xdoctest: +SKIP("needs transformers")
    >>> from torch_tp.integrations.transformers import parallelize
"""

__all__: list[str] = []
