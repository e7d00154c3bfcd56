"""Which ``context_parallel`` block a call sees (Note [the context in a backward] in
hcp_compile/context.py): its own thread's; inside a backward run where no block of its own
thread is open (CUDA's autograd thread), the one block open in the process; with several open,
an error. End to end (a checkpointed layer's backward on another thread): tests/cp_cases.py,
``BackwardOnAnotherThreadCase``."""

from __future__ import annotations

import torch

from hcp_compile import context
from hcp_compile.validation import InputError


class SeenInBackward(torch.autograd.Function):
    """Identity whose backward records what ``active_context()`` gives (or raises) there."""

    @staticmethod
    def forward(ctx, x, seen: list):
        ctx.seen = seen
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        try:
            ctx.seen.append(context.active_context())
        except InputError as error:
            ctx.seen.append(error)
        return grad, None


def seen_in_backward() -> object:
    seen: list = []
    SeenInBackward.apply(torch.ones(2, requires_grad=True), seen).sum().backward()
    return seen[0]


def test_no_block_open_is_none_in_a_backward_too(monkeypatch):
    monkeypatch.setattr(context, "_OPEN", [])
    assert context.active_context() is None
    assert seen_in_backward() is None


def test_a_block_open_elsewhere_is_taken_only_inside_a_backward(monkeypatch):
    block = object()
    monkeypatch.setattr(context, "_OPEN", [block])
    assert context.active_context() is None  # a forward outside any block stays single-device
    assert seen_in_backward() is block


def test_several_blocks_open_elsewhere_raise_inside_a_backward(monkeypatch):
    monkeypatch.setattr(context, "_OPEN", [object(), object()])
    error = seen_in_backward()
    assert isinstance(error, InputError)
    assert "2 context_parallel blocks are open in other threads" in str(error)


def test_a_block_entered_twice_is_one_block(monkeypatch):
    block = object()
    monkeypatch.setattr(context, "_OPEN", [block, block])  # nested re-entry of the same block
    assert seen_in_backward() is block
