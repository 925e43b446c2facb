"""Runs test_fla.py's cases, and LMs' training steps and cached forwards, through the fla kernel on fla's real
Triton kernels, in Triton's interpreter on the CPU, and saves outputs and gradients for
test_fla.py to judge; some cases again inside torch.compile (``COMPILED``), counting the
kernels' calls. A case of ``op`` 'delta' runs ``chunk_delta_rule`` (the delta rule), any other
``causal_linear_attention``.

    python fla_interpreted.py cases.pt results.pt

A script of its own: TRITON_INTERPRET must be set before triton is first imported.
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from triton.runtime import autotuner, interpreter  # noqa: E402

import torch.nn.functional as F  # noqa: E402

from linear_attention_transformer import LinearAttentionTransformerLM  # noqa: E402
from linear_attention_transformer.ops import causal_linear_attention  # noqa: E402
from linear_attention_transformer.ops.causal import fla as fla_form  # noqa: E402
from linear_attention_transformer.ops.delta import chunk_delta_rule  # noqa: E402

# The autotuner times its configurations with a benchmarker that needs a GPU driver. Timing
# every configuration as 0 makes it keep the first, which is all the interpreter needs.
autotuner.Autotuner.do_bench = property(lambda self: lambda kernel_call, quantiles=None, **_: [0.0] * len(quantiles))


class _LoopIndexAsTensor(interpreter.ASTTransformer):
    """A compiled kernel's loop index is a Triton scalar; the interpreter's is a Python int, on
    which fla-core 0.6's ``i_t.to(tl.int64)`` fails. Each ``for i in ...`` loop here starts
    with ``i = i``, an assignment the interpreter turns into a Triton scalar: the kernels' own
    code is unchanged, only the interpreter's reading of it."""

    def visit_For(self, node):
        self.generic_visit(node)
        if isinstance(node.target, interpreter.ast.Name):
            name = node.target.id
            rebind = interpreter.ast.Assign(targets=[interpreter.ast.Name(id=name, ctx=interpreter.ast.Store())],
                                            value=interpreter.ast.Name(id=name, ctx=interpreter.ast.Load()))
            node.body.insert(0, self.visit_Assign(rebind))
        return node


interpreter.FunctionRewriter.ast_transformer = _LoopIndexAsTensor()


def part(t, sl):
    """Tokens ``sl`` of a (b, n) mask or a (b, h, n, ...) tensor (None stays None)."""
    return None if t is None else t[:, sl] if t.ndim == 2 else t[:, :, sl]


def outputs(case, leaves):
    """The case's output from its leaves (q, k, v, log_decay) in the fla kernel."""
    options = dict(exp_features=case["exp_features"], blindspot_size=case["blindspot_size"], kernel="fla")
    split = case["split"]
    if split is None:
        return causal_linear_attention(*leaves, mask=case["mask"], segments=case["segments"], **options)
    # a prefix returns the state, the rest continues from it
    head, state = causal_linear_attention(*(part(t, slice(0, split)) for t in leaves),
                                          mask=part(case["mask"], slice(0, split)), return_state=True, **options)
    tail = causal_linear_attention(*(part(t, slice(split, None)) for t in leaves), state=state,
                                   mask=part(case["mask"], slice(split, None)), **options)
    return torch.cat((head, tail), dim=2)


def delta_outputs(case, leaves):
    """The delta case's output and last state from its leaves (q, k, v, beta, log_decay, state)
    in fla's kernel: in one call, or a prefix and the rest from the state it returns."""
    *tokens, state = leaves
    options = dict(return_state=True, kernel="fla")
    split = case["split"]
    if split is None:
        return chunk_delta_rule(*tokens, mask=case["mask"], state=state, segments=case["segments"], **options)
    head, state = chunk_delta_rule(*(part(t, slice(0, split)) for t in tokens), state=state,
                                   mask=part(case["mask"], slice(0, split)), **options)
    tail, last = chunk_delta_rule(*(part(t, slice(split, None)) for t in tokens), state=state,
                                  mask=part(case["mask"], slice(split, None)), **options)
    return torch.cat((head, tail), dim=2), last


LEAVES = {"additive": ("q", "k", "v", "log_decay"), "delta": ("q", "k", "v", "beta", "log_decay", "state")}
FORWARDS = {"additive": outputs, "delta": delta_outputs}


def run(case, forward=None):
    """Output, gradients of its weighted sum (and of the last state's, for the delta rule) with
    respect to the case's leaves, the delta rule's last state, and whether forward and backward
    left the leaves as they were."""
    op = case.get("op", "additive")
    leaves = [None if case[name] is None else case[name].clone().requires_grad_() for name in LEAVES[op]]
    out = (forward or FORWARDS[op])(case, leaves)
    out, last = out if op == "delta" else (out, None)
    loss = (out * case["weight"]).sum()
    if last is not None:
        loss = loss + (last * case["state_weight"]).sum()
    present = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(loss, present)
    result = dict(out=out.detach(), grads=[g.detach() for g in grads],
                  inputs_unchanged=all(t is None or torch.equal(t, case[name]) for name, t in zip(LEAVES[op], leaves)))
    return result if last is None else dict(result, state=last.detach())


def run_lm(config, tokens):
    """An LM's logits and parameter gradients (cross-entropy of the next token) in the fla kernel,
    with its parameters."""
    torch.manual_seed(0)
    model = LinearAttentionTransformerLM(**config, kernel="fla")
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    # the same logits from a cache: a prefill that ends inside a blindspot block, then several
    # tokens, one token, and the rest, each continuing from the state the last returned
    cached, cache = [], None
    with torch.no_grad():
        for piece in (slice(0, 29), slice(29, 37), slice(37, 38), slice(38, tokens.shape[1] - 1)):
            out, cache = model(tokens[:, piece], cache=cache, return_cache=True)
            cached.append(out)
    return dict(state=model.state_dict(), logits=logits.detach(), cached=torch.cat(cached, dim=1),
                grads={name: p.grad for name, p in model.named_parameters()})


COMPILED = (0, 2)  # the cases also run inside torch.compile


def run_compiled(case):
    """``run`` with its forward inside torch.compile (aot_eager: dynamo's graphs and autograd's,
    without code generation; the backward outside, as a training step has it), with the
    number of calls that reached fla's kernels."""
    calls = []
    kernels = fla_form._kernels()

    def counted(kernel):
        @torch.compiler.disable
        def call(*args, **kwargs):
            calls.append(kernel.__name__)
            return kernel(*args, **kwargs)
        return call

    fla_form._kernels = lambda: tuple(counted(kernel) for kernel in kernels)
    try:
        result = run(case, torch.compile(outputs, backend="aot_eager"))
    finally:
        fla_form._kernels = lambda: kernels
    return dict(result, calls=calls)


if __name__ == "__main__":
    cases, lm = torch.load(sys.argv[1])
    results = [run(case) for case in cases]
    compiled = {index: run_compiled(cases[index]) for index in COMPILED}
    lms = {name: run_lm(config, lm["tokens"]) for name, config in lm["configs"].items()}
    torch.save((results, lms, compiled), sys.argv[2])
