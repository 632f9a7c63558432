"""Rank supervision, private to torch_tp: what a failing rank records (:mod:`.rank_failure`),
which rank failed first (:mod:`.root_cause`), ranks that die with the process that started them
(:mod:`.orphans`) and, under ``torchrun``, which peers stopped beating (:mod:`.heartbeat`).

:mod:`torch_tp.launch` and :mod:`torch_tp.testing` are built on it; users call those.
"""
