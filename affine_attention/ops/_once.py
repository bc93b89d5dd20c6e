"""Second derivatives through the ops' hand-written backwards are refused by name, never computed wrong.

The custom autograd.Functions here (the kernel with its sink, the epilogue) compute their backward with raw kernels
and saved tensors: differentiating that backward again would miss its dependence on q, k, v and give a wrong
Hessian-vector product with no error. torch's `once_differentiable` refuses only when the incoming gradient itself
requires grad, so `grad(out, q, create_graph=True)` followed by `grad(dq, ...)` would still end in torch's vague
"does not require grad" message; this decorator refuses whenever the backward runs with create_graph=True.
"""
from __future__ import annotations

import functools

import torch
from torch._C import _functions

MESSAGE = ("affine_attention: a second derivative through {name} is not supported (its backward is hand-written and "
           "once-differentiable). For higher-order gradients use the float64 reference ops "
           "(affine_attention.ops.*_reference), or plain softmax on backend='sdpa'.")


def once_differentiable(name: str):
    """Decorator for a Function's backward(ctx, *grads): run it without building a graph; under create_graph=True
    its outputs carry a node that raises MESSAGE if anything differentiates through them."""
    def wrap(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            with torch.no_grad():
                outputs = backward(ctx, *grads)
            if not torch.is_grad_enabled():
                return outputs
            outs = outputs if isinstance(outputs, tuple) else (outputs,)
            # The refusing node also takes the Function's saved inputs that require grad, so that differentiating the
            # gradients towards them (q, k, v, ...) runs it and raises, instead of finding no path and returning None.
            sources = [t for t in ctx.saved_tensors if t is not None and t.requires_grad]
            refuse = _functions.DelayedError(MESSAGE.format(name=name).encode(), len(outs) + len(sources))
            aliased = refuse(*[o if o is None else o.detach().requires_grad_() for o in outs], *sources)
            aliased = tuple(aliased)[:len(outs)]
            return aliased if isinstance(outputs, tuple) else aliased[0]
        return wrapper
    return wrap
