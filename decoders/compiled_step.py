"""A decoder step compiled for fixed shapes, called as a function of its tensors.

A function compiled by torch.compile passes every call through Dynamo: its frame hook, its guards
and the configuration it patches around the call. At a small model's decoder call on a CPU that
is about a third of the call. A loop whose calls take a few fixed shapes needs none of it after
a shape's first call: `FixedShapeStep` traces the step once per shape into a graph of tensors
(every tensor its arguments hold, in `DecoderCache`s, tuples and lists too, of which the ones the
graph reads; the model's weights it reads are the graph's constants), compiles that graph with
inductor, and calls it with those tensors, read from each call's arguments in the same order by
one generated function. What
the graph took as constants (the arguments' ints, None and other values) are checked at every
call, and the sizes and strides of its tensors by the graph's C++ wrapper: a call in another
shape fails instead of reading out of bounds.

A step that puts new tensors into its arguments (a cache it would make or grow) is not a
function of the tensors it is given: it runs through torch.compile (its `fallback`), as does a
step that cannot be traced. The decoding loops make their cache whole before their first call
(`backbone.fixed_shape_start`), so every call of theirs runs as a graph.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch import nn

from decoders.cache import DecoderCache


class Applied(nn.Module):
    """`function(model, *args)` as a module call, so that `torch.func.functional_call` can run it
    with the model's weights swapped for other tensors."""

    def __init__(self, model: nn.Module, function: Callable):
        super().__init__()
        self.model = model
        self.function = function

    def forward(self, *args):
        return self.function(self.model, *args)


class FixedShapeStep:
    """`function(model, *args)` for one shape of its arguments, compiled at its first call with
    inductor's `options`: a graph of the arguments' tensors holding the model's weights, or, where the
    call puts new tensors into its arguments, `fallback` (the same function through
    torch.compile)."""

    def __init__(self, function: Callable, fallback: Callable, options: dict):
        # not the model: the step is kept with it, and would keep it alive
        self.function, self.fallback, self.options = function, fallback, options
        self.made = False                             # whether a first call compiled it
        self.compiled: Callable | None = None         # the graph's; None: `fallback` runs it
        self.tensors_of: Callable[[tuple], list] = list
        self.constants_of: Callable[[tuple], tuple] = tuple
        self.constants: tuple = ()
        self.single = False                           # whether the function returns one tensor
        self.weights: list[torch.Tensor] = []         # the model's weights the graph holds

    def __call__(self, model: nn.Module, *args: Any):
        if not self.made:
            self.compiled, self.made = self.compile(model, args), True
            COMPILED_STEPS.append(self.function.__name__)
        if self.compiled is None:
            return self.fallback(model, *args)
        if self.constants_of(args) != self.constants:
            raise RuntimeError(f"a call of {self.function.__name__} with other constants than its "
                               f"fixed-shape step was compiled for: {self.constants_of(args)}, "
                               f"not {self.constants}")
        out = self.compiled(self.tensors_of(args))   # a list it empties
        return out[0] if self.single else tuple(out)

    def compile(self, model: nn.Module, args: tuple) -> Callable | None:
        """The step of `args`' shape as a compiled graph of tensors; None where the call puts new
        tensors into its arguments, or cannot be traced."""
        tensor_paths: list[str] = []
        constant_paths: list[str] = []
        rebuild = _layout(args, "a", tensor_paths, constant_paths)
        tensors_of, constants_of = _getter(tensor_paths, "[]"), _getter(constant_paths, "()")
        weights = {f"model.{name}": tensor for name, tensor in
                   [*model.named_parameters(), *model.named_buffers()]}
        applied, names, count = Applied(model, self.function), list(weights), len(weights)
        kept, single = [], []   # whether the call kept its arguments' tensors; its output's form

        def graph(*flat):
            rebuilt = rebuild(iter(flat[count:]))
            out = torch.func.functional_call(applied, dict(zip(names, flat[:count])), rebuilt,
                                             tie_weights=True, strict=False)
            after: list[str] = []
            _layout(rebuilt, "a", after, [])
            kept.append(after == tensor_paths and all(
                held is given for held, given in zip(_getter(after, "[]")(rebuilt), flat[count:])))
            single.append(isinstance(out, torch.Tensor))
            return (out,) if single[-1] else tuple(out)

        # what compiling needs, at its first use
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx_inner
        from torch._inductor.decomposition import select_decomp_table
        from torch.fx.experimental.proxy_tensor import make_fx
        tensors = tensors_of(args)
        example = [*weights.values(), *tensors]
        try:
            with torch.no_grad():
                # in the operators inductor lowers; the cache's writes stay writes into its tensors
                traced = make_fx(graph, tracing_mode="fake",
                                 decomposition_table=select_decomp_table())(*example)
        except Exception:   # what Dynamo runs but tracing does not: the fallback's
            return None
        if not kept[-1]:
            return None
        # inputs the graph never reads (the encoder's weights, arguments the step ignores) left
        # out, and the weights it reads made its constants, which it holds (so it reads what is
        # written into them in place): each input costs the call a handle
        placeholders = [node for node in traced.graph.nodes if node.op == "placeholder"]
        read = [bool(node.users) for node in placeholders]
        body = next(node for node in traced.graph.nodes if node.op != "placeholder")
        for position, (node, used, weight) in enumerate(zip(placeholders, read, weights.values())):
            if used:
                traced.register_buffer(f"weight_{position}", weight.detach(), persistent=False)
                with traced.graph.inserting_before(body):
                    constant = traced.graph.get_attr(f"weight_{position}")
                constant.meta = dict(node.meta)
                node.replace_all_uses_with(constant)
        for node, used in zip(placeholders, [False] * count + read[count:]):
            if not used:
                traced.graph.erase_node(node)
        traced.recompile()
        example = [tensor for tensor, used in zip(tensors, read[count:]) if used]
        tensors_of = _getter([path for path, used in zip(tensor_paths, read[count:]) if used], "[]")
        # inductor's graph itself, an inference graph: not wrapped by AOT autograd, whose wrappers
        # (gradients, aliasing, views of outputs) a graph of tensors under no_grad needs none of,
        # and cost a tenth of a small decoder call
        with torch.no_grad(), config.patch(self.options):
            graph_code = compile_fx_inner(traced, example, is_inference=True,
                                          cpp_wrapper=bool(self.options.get("cpp_wrapper")))
        self.single = single[-1]
        self.weights = [weight for weight, used in zip(weights.values(), read) if used]
        self.tensors_of, self.constants_of = tensors_of, constants_of
        self.constants = constants_of(args)
        # the generated module's function of a list of the graph's inputs, called without the
        # per-call bookkeeping of the graph object around it
        return graph_code.current_callable


# The function of every step compiled in this process, in order: a decode after a warm-up adds none.
COMPILED_STEPS: list[str] = []

# what a `DecoderCache` holds, in a graph's order
CACHE_PARTS = ("keys", "values", "encoder_keys_values", "positions")


def _layout(value: Any, path: str, tensors: list[str], constants: list[str]) -> Callable[[Iterator], Any]:
    """Walk `value` (reached from the arguments by `path`), appending the path of every tensor it
    holds to `tensors` and of every other leaf to `constants`; returns what rebuilds a value of its
    form from an iterator of tensors in that order (the constants as they are)."""
    if isinstance(value, torch.Tensor):
        tensors.append(path)
        return next
    if isinstance(value, DecoderCache):
        parts = {name: _layout(getattr(value, name), f"{path}.{name}", tensors, constants)
                 for name in CACHE_PARTS}
        layers, most_slots = len(value.keys), value.most_slots

        def cache(values):
            made = DecoderCache(layers, most_slots)
            for name, part in parts.items():
                setattr(made, name, part(values))
            return made
        return cache
    if isinstance(value, (tuple, list)):
        items = [_layout(item, f"{path}[{i}]", tensors, constants) for i, item in enumerate(value)]
        kind = type(value)
        made = kind._make if hasattr(kind, "_fields") else kind   # a NamedTuple, or a plain one
        return lambda values: made([item(values) for item in items])
    constants.append(path)
    return lambda values: value


def _getter(paths: list[str], brackets: str) -> Callable[[tuple], Any]:
    """One function of the arguments `a` returning the values at `paths` (built by `_layout`),
    as a list ("[]") or a tuple ("()"): one call per step, not one per value."""
    opening, closing = brackets
    return eval(f"lambda a: {opening}{', '.join(paths)}{',' if paths else ''}{closing}")
