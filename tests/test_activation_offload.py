"""Activation offload's host copies: one copy per storage autograd saves views of (Note [one
copy a storage] in activation_offload.py), never more bytes than a copy per saved tensor, and
gradients bitwise those of the module that keeps its activations. One process, no group."""

import copy

import torch
import torch.nn as nn

from shardwise.core.activation_offload import Offload, is_activation
from shardwise.job.models.gpt import GPT, gpt_config


class SavesViews(torch.autograd.Function):
    """Saves chosen views of two fresh tensors; backward reads each, so a wrong view or
    stride shows in the gradient."""

    @staticmethod
    def forward(ctx, a):
        b = a * 2  # 8 x 6
        c = a * 3
        small = a[0] * 5  # 6 elements, expanded below
        ctx.save_for_backward(b.t(), b, b[1:], b[:1].expand_as(b), c[:1], small.expand(8, 6), c[:1])
        return a * b

    @staticmethod
    def backward(ctx, g):
        bt, b, tail, first, c_row, wide, c_again = ctx.saved_tensors
        assert bt.stride() == (1, 6) and first.stride() == (0, 1) and wide.stride() == (0, 1)
        out = g * (bt.t() + b) + c_row * first + wide + c_again
        out[1:] += tail
        return out


class Views(nn.Module):
    def forward(self, a):
        return SavesViews.apply(a)


def offloaded(module: nn.Module) -> Offload:
    offload = Offload(torch.device("cpu"))
    offload.wrap(module, "m")
    return offload


def test_views_of_one_storage_are_copied_once():
    a = torch.randn(8, 6, requires_grad=True)
    a_ref = a.detach().clone().requires_grad_()
    views = Views()
    offload = offloaded(views)
    views(a).square().sum().backward()
    SavesViews.apply(a_ref).square().sum().backward()
    assert torch.equal(a.grad, a_ref.grad)
    # b once (its transpose, tail and expanded first row are views of that copy); c's first row
    # alone (a copy of c would be 8x larger), once though saved twice; small as its 6
    # elements, not the 48 of its expand
    assert offload.bytes_out == (48 + 6 + 6) * 4
    assert offload.on_host == 0  # all dropped once backward fetched them


def saved_bytes(model: nn.Module, modules: list[nn.Module], x: torch.Tensor) -> int:
    """Bytes of the activations ``modules`` save in a step of ``model``: what a copy per
    saved tensor would offload."""
    total = 0

    def pack(t):
        nonlocal total
        if is_activation(t):
            total += t.numel() * t.element_size()
        return t

    counting = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    handles = [
        h
        for m in modules
        for h in (
            m.register_forward_pre_hook(lambda *_: counting.__enter__()),
            m.register_forward_hook(lambda *_: counting.__exit__(None, None, None)),
        )
    ]
    model(x).square().sum().backward()
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    return total


def test_gpt_gradients_are_bitwise_and_bytes_fewer():
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    ref = copy.deepcopy(model)
    x = torch.randint(0, 256, (2, 32))
    per_tensor = saved_bytes(model, list(model.blocks), x)
    offload = Offload(torch.device("cpu"))
    for i, block in enumerate(model.blocks):
        offload.wrap(block, f"blocks.{i}")
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    # attention's output and its (tokens, width) view for the projection: one copy
    assert 0 < offload.bytes_out < per_tensor
    assert offload.on_host == 0
