"""The registry of handler sets (``torch_tp.conv._registry``): one install idiom for every set, and a
spatial model that changes nothing for the DTensor code beside it.

Every set is checked by the same test: installs nest, the matching uninstall puts back the very
entries it replaced, the context manager restores them on exceptions, other sets stay as they
are. On real ranks, a plain DTensor program (an op of every set, on sharded inputs) gives the
same results and the same errors before a spatial model exists, while one lives (after its
forward and backward) and after it is deleted.
"""

import copy
import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import torch_tp  # noqa: F401  (importing torch_tp installs nothing)
from torch_tp import SpatialParallel, parallelize_module
from torch_tp.conv import _registry
from torch_tp.models import cnn
from torch_tp.testing import TOL, local_chunk, on_ranks, tp_mesh

SETS = _registry.handler_sets()
_MISSING = object()


def _entries(handler_set):
    table = DTensor._op_dispatcher._custom_op_handlers
    return {op: table.get(op, _MISSING) for op in handler_set.handlers}


def _name(handler_set):
    return handler_set.owner.rsplit(".", 1)[1]


def test_the_registry_lists_every_handler_module_once():
    names = [_name(s) for s in SETS]
    assert sorted(names) == ["batch_norm", "global_mean", "group_norm", "padding", "pointwise", "pooling",
                             "sharded_conv", "transposed_conv", "upsample"]
    for op in {op for s in SETS for op in s.handlers}:  # an op two sets claim is told apart by when=
        claims = [s for s in SETS if op in s.handlers]
        assert len(claims) == 1 or all(op in s.whens for s in claims), op


def test_import_installs_nothing():
    assert not any(s.is_installed() for s in SETS)
    table = DTensor._op_dispatcher._custom_op_handlers
    assert not any(isinstance(entry, _registry._Gate) for entry in table.values())


@pytest.mark.parametrize("handler_set", SETS, ids=_name)
def test_install_nests_and_uninstall_restores_the_exact_entries(handler_set):
    other = next(s for s in SETS if s is not handler_set)
    before = _entries(handler_set)
    assert not handler_set.is_installed()
    with other.installed():  # the other sets stay independent
        handler_set.install()
        entries = _entries(handler_set)
        assert all(isinstance(entry, _registry._Gate) and handler_set.handlers[op] in entry.handlers()
                   for op, entry in entries.items())
        handler_set.install()
        handler_set.uninstall()
        assert handler_set.is_installed() and _entries(handler_set) == entries
        handler_set.uninstall()
        assert all(now is was for now, was in zip(_entries(handler_set).values(), before.values(), strict=True))
        assert not handler_set.is_installed() and other.is_installed()
    with pytest.raises(RuntimeError, match="without a matching install"):
        handler_set.uninstall()


@pytest.mark.parametrize("handler_set", SETS, ids=_name)
def test_the_context_manager_restores_on_exceptions(handler_set):
    before = _entries(handler_set)
    with pytest.raises(KeyError):
        with handler_set.installed():
            with handler_set.installed():
                raise KeyError("boom")
    assert all(now is was for now, was in zip(_entries(handler_set).values(), before.values(), strict=True))
    assert not handler_set.is_installed()


def test_each_module_exposes_its_set_through_the_same_four_functions():
    import importlib

    for handler_set in SETS:
        module = importlib.import_module(handler_set.owner)
        assert module.HANDLERS is handler_set
        module.install()
        assert module.is_installed() and handler_set.runs_everywhere()
        module.uninstall()
        assert not module.is_installed()


# ---------------------------------------------------------------------------------------------
# A spatial model holds its sets while it lives, and changes nothing outside it
# ---------------------------------------------------------------------------------------------


def _outcome(fn):
    """What a DTensor program gives: placements and whole values, or the error's type and text."""
    try:
        out = fn()
    except Exception as err:  # noqa: BLE001 - the error is the outcome
        return ("raised", type(err).__name__, str(err).split("\n")[0][:200])
    outs = out if isinstance(out, tuple) else (out,)
    return tuple((tuple(o.placements), o.full_tensor()) if isinstance(o, DTensor) else o for o in outs)


def _plain_dtensor_program(mesh):
    """An op of every handler set on width-sharded DTensors (9 columns: uneven strips), no spatial model."""
    torch.manual_seed(1)
    image = torch.randn(2, 4, 5, 9)
    x = distribute_tensor(image, mesh, [Shard(3)])
    h = distribute_tensor(torch.randn(2, 4, 3, 6), mesh, [Shard(2)])  # height 3: empty strips at 4 ranks
    w = distribute_tensor(torch.randn(6, 4, 3, 3), mesh, [Replicate()])
    cases = {
        "conv": lambda: F.conv2d(x, w, padding=1),
        "batch_norm": lambda: F.batch_norm(x, None, None, training=True),
        "group_norm": lambda: F.group_norm(x, 2),
        "layer_norm": lambda: F.layer_norm(h.permute(0, 2, 3, 1), (4,)),
        "max_pool": lambda: F.max_pool2d(x, 2),
        "avg_pool": lambda: F.avg_pool2d(x, 3, stride=2, padding=1),
        "upsample": lambda: F.interpolate(x, scale_factor=2, mode="bilinear"),
        "pad": lambda: F.pad(x, (1, 2)),
        "mean": lambda: x.mean((2, 3)),
        "hardswish_backward": lambda: torch.ops.aten.hardswish_backward.default(x, x),
        "mish_backward": lambda: torch.ops.aten.mish_backward.default(h, h),
    }
    return {name: _outcome(case) for name, case in cases.items()}


def _assert_same(now, before, when):
    assert now.keys() == before.keys()
    for name in before:
        a, b = now[name], before[name]
        if a and a[0] == "raised":
            assert a == b, f"{when}: {name} now {a}, before {b}"
            continue
        assert len(a) == len(b) and all(x[0] == y[0] for x, y in zip(a, b)), f"{when}: {name} placements differ"
        for x, y in zip(a, b):
            torch.testing.assert_close(x[1], y[1], rtol=0, atol=0, msg=lambda m: f"{when}: {name}: {m}")


def _train_once(model, image, dim):
    out = model(local_chunk(image, dim))
    out.float().pow(2).mean().backward()
    return out


@on_ranks(2, 4)
def test_a_plain_dtensor_program_is_the_same_before_during_and_after_a_spatial_model():
    mesh = tp_mesh()
    before = _plain_dtensor_program(mesh)
    assert any(o[0] == "raised" for o in before.values())  # errors are compared too
    gc.collect()  # models earlier tasks left to the collector let go of their sets now, not below
    held = [s._holders for s in SETS]

    torch.manual_seed(0)
    reference = cnn.unet(num_classes=2, width=4, depth=2)
    model = parallelize_module(copy.deepcopy(reference), mesh, SpatialParallel(dim=3))
    image = torch.randn(2, 3, 8, 12)
    out = _train_once(model, image, 3)
    torch.testing.assert_close(out, local_chunk(reference(image), 3), **TOL)  # the model itself is spatial
    assert [s._holders for s in SETS] == [n + 1 for n in held] and all(s.is_installed() for s in SETS)
    assert not _registry.scope_active()
    _assert_same(_plain_dtensor_program(mesh), before, "while a spatial model lives")

    del model, out
    gc.collect()
    assert [s._holders for s in SETS] == held
    _assert_same(_plain_dtensor_program(mesh), before, "after the spatial model is deleted")


@on_ranks(2)
def test_applying_the_style_twice_holds_the_sets_twice_and_enters_the_table_once():
    # (upstream's own convolution handler stays behind the entry, for every other caller)
    conv_set = next(s for s in SETS if _name(s) == "sharded_conv")
    table = DTensor._op_dispatcher._custom_op_handlers
    op = torch.ops.aten.convolution.default
    gc.collect()
    held = conv_set._holders
    models = [parallelize_module(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1)), tp_mesh(), {"*": SpatialParallel(dim=3)})
              for _ in range(2)]
    gate = table[op]
    assert conv_set._holders == held + 2 and isinstance(gate, _registry._Gate)
    assert not isinstance(gate.replaced, _registry._Gate)  # the entry it replaced is upstream's
    with pytest.raises(ValueError, match="batched 4-D"):  # a forward that raises leaves the scope too
        models[0](torch.randn(3, 8, 8))
    assert not _registry.scope_active()
    del models
    gc.collect()
    assert conv_set._holders == held


@on_ranks(2)
@pytest.mark.parametrize("plan", ["region", "layers"])
def test_torch_compile_runs_a_spatial_model_eagerly_like_one_process_and_fullgraph_raises_at_compile_time(plan):
    # traced, the scope hooks would be deferred and the handlers would meet fake strips: silently
    # wrong results (1e28 off with aot_eager, a halo deadlock); backend="eager" failed on BatchNorm's
    # running statistics. The model runs eagerly inside the compiled program, for every backend
    torch.manual_seed(0)
    original = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1))
    style = SpatialParallel(dim=3) if plan == "region" else {"*": SpatialParallel(dim=3)}
    x = torch.randn(2, 3, 8, 12)
    for backend in ("eager", "aot_eager"):
        torch._dynamo.reset()
        reference = copy.deepcopy(original)
        model = parallelize_module(copy.deepcopy(original), tp_mesh(), style)
        out = torch.compile(model, backend=backend)(local_chunk(x, 3))
        want = reference(x)
        out = out.to_local() if isinstance(out, DTensor) else out
        torch.testing.assert_close(out, local_chunk(want, 3), **TOL, msg=lambda m, b=backend: f"{b}: {m}")
        out.sum().backward()
        want.sum().backward()
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            torch.testing.assert_close(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad, q.grad,
                                       **TOL, msg=lambda m, name=name, b=backend: f"{b}: grad of {name}: {m}")
        running = model[1].running_mean
        torch.testing.assert_close(running.full_tensor() if isinstance(running, DTensor) else running,
                                   reference[1].running_mean, **TOL)
    torch._dynamo.reset()
    with pytest.raises(Exception):  # at compile time: a graph break (ours names torch_tp.conv) or a dynamic size
        torch.compile(model, backend="aot_eager", fullgraph=True)(local_chunk(x, 3))
    torch._dynamo.reset()
