"""Entry points of user models that are wrong in each way meshjob must report (tests/test_custom.py),
and a good one built from examples/custom_model's conv_lm."""

from __future__ import annotations

from torch import nn

from meshjob_trainer.custom import CustomModel

NOT_CALLABLE = 42


def good(config, model):
    import conv_lm

    return conv_lm.build(config, model)


def raises(config, model):
    raise KeyError("depth")


def returns_a_dict(config, model):
    return {"embedding": nn.Identity()}


def too_few_blocks(config, model):
    parts = good(config, model)
    return CustomModel(parts.embedding, list(parts.blocks)[:-1], parts.head, parts.boundary)


def wrong_boundary(config, model):
    parts = good(config, model)
    return CustomModel(parts.embedding, parts.blocks, parts.head, (model.seq_len, model.hidden * 2))


def block_is_no_module(config, model):
    parts = good(config, model)
    return CustomModel(parts.embedding, [len] + list(parts.blocks)[1:], parts.head, parts.boundary)


def forward_fails(config, model):
    parts = good(config, model)
    blocks = list(parts.blocks)
    blocks[1] = nn.Linear(model.hidden + 1, model.hidden)
    return CustomModel(parts.embedding, blocks, parts.head, parts.boundary)


def head_too_narrow(config, model):
    parts = good(config, model)
    return CustomModel(parts.embedding, parts.blocks, nn.Linear(model.hidden, model.vocab - 1), parts.boundary)
