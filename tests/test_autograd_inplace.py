"""The facts and words of ``inplace_error``, as pure functions and tables: parsing PyTorch's message, which
cause speaks, and the words each cause has. (End-to-end cases are in test_autograd_errors.py.)"""

from __future__ import annotations

import weakref

import torch
from torch import nn

import gradwatch
from gradwatch.diagnose.autograd import ERRORS
from gradwatch.diagnose.autograd.inplace import PARAM_WRITE_FIXES, param_writer_cause
from gradwatch.diagnose.autograd.inplace_common import CULPRITS, WHY_INPLACE, InplaceError, parse_inplace_error
from gradwatch.diagnose.autograd.inplace_forward import (
    FORWARD_CASES,
    LEAF_FIXES,
    ForwardInplaceFacts,
    forward_words,
    leaf_fix,
)
from gradwatch.diagnose.autograd.inplace_traced import (
    UNTRACED_WORDS,
    WRITER_PLACES,
    UntracedFacts,
    WriterFacts,
    writer_fix,
)
from gradwatch.observe.tracing import InplaceRecord

_MESSAGE = (
    "one of the variables needed for gradient computation has been modified by an inplace operation: "
    "[torch.FloatTensor [8, 4]], which is output 0 of SigmoidBackward0, is at version 3; expected version 1 "
    "instead. Hint: enable anomaly detection to find the operation that failed to compute its gradient."
)


def _parse(text: str) -> InplaceError:
    pattern, _explainer = ERRORS[0]
    m = pattern.search(text)
    assert m is not None
    return parse_inplace_error(m)


def test_the_message_gives_type_shape_op_and_versions() -> None:
    err = _parse(_MESSAGE)
    assert (err.tensor_type, err.shape, err.shape_text) == ("torch.FloatTensor", (8, 4), "[8, 4]")
    assert (err.raw_op, err.op, err.now, err.expected) == ("SigmoidBackward0", "Sigmoid", 3, 1)
    assert err.versions == "saved at version 1, now at version 3 (2 in-place changes)"
    assert not err.of_a_leaf_or_view  # a sigmoid's output: not a parameter or buffer


def test_a_message_without_an_op_or_with_a_view_op_may_be_a_leaf() -> None:
    unnamed = _parse(
        "modified by an inplace operation: [torch.FloatTensor [4]] is at version 1; expected version 0 instead"
    )
    assert unnamed.raw_op is None and unnamed.op is None and unnamed.shape == (4,) and unnamed.of_a_leaf_or_view
    assert unnamed.versions.endswith("(1 in-place change)")
    view = _parse(_MESSAGE.replace("SigmoidBackward0", "TBackward0"))
    assert view.op == "T" and view.of_a_leaf_or_view


def _record(op: str) -> InplaceRecord:
    t = torch.zeros(1)
    return InplaceRecord(tensor=weakref.ref(t), base=None, op=op, module="emb", source=None, version_before=0,
                         version_after=1)


def test_a_parameter_written_outside_the_forward_is_blamed_on_optimizer_step() -> None:
    assert param_writer_cause(None) == "optimizer_step"
    assert "optimizer.step()" in PARAM_WRITE_FIXES["optimizer_step"]("w")


def test_an_embedding_with_max_norm_writing_its_weight_has_its_own_fix() -> None:
    assert param_writer_cause(_record("torch.nn.functional.embedding")) == "embedding_max_norm"
    fix = PARAM_WRITE_FIXES["embedding_max_norm"]("emb.weight")
    assert "max_norm" in fix and "weight.clone()" in fix
    assert param_writer_cause(_record("Tensor.mul_")) == "forward_write"


def test_forward_leaf_writes_pick_their_fix_by_what_the_write_is_for() -> None:
    assert leaf_fix(nn.Embedding(4, 2), "model.py:3: self.emb.weight[0] = 0") == "embedding_padding"
    assert leaf_fix(nn.Embedding(4, 2, padding_idx=0), "model.py:3: self.emb.weight[0] = 0") == "no_grad"
    assert leaf_fix(None, "train.py:9: p.clamp_(-0.01, 0.01)") == "weight_clipping"
    assert leaf_fix(nn.Linear(2, 2), None) == "no_grad"
    assert set(LEAF_FIXES) == {"no_grad", "embedding_padding", "weight_clipping"}


def test_every_forward_case_has_what_where_why_and_fix() -> None:
    for case in FORWARD_CASES:
        f = ForwardInplaceFacts(
            step=2, case=case, text="a leaf Variable that requires grad is being used in an in-place operation.",
            module="enc", source="m.py:7: x += 1", op="Split", index=1, made="pooled", param="enc.weight",
        )
        words = forward_words(f)
        assert words.what.split("\n")[1].startswith("Where: the forward of module enc, at m.py:7: x += 1")
        assert words.why and words.fix and not words.fix.startswith("Fix:") and not words.cause


def test_a_view_of_a_multi_output_op_names_how_the_user_called_it() -> None:
    f = ForwardInplaceFacts(step=0, case="multi_output_view", text="", op="Unbind", index=0)
    words = forward_words(f)
    assert "unbind() (or iterating over a tensor)" in words.what
    assert words.what.endswith("Where: the forward of module <outside the model>.")
    leaf = forward_words(ForwardInplaceFacts(step=0, case="created_leaf", text="t", made="pooled"))
    assert leaf.what.endswith("Where: outside the model.") and "`pooled = pooled + h`" in leaf.fix


def test_an_in_place_writer_is_placed_by_the_modules_that_can_run_it_in_place() -> None:
    relu = nn.ReLU(inplace=True)
    only = WriterFacts("Relu", ("ReLU",), [("act", relu)], [], traced=False)
    assert only.place == "only_inplace_module" and only.fn == "relu"
    assert WriterFacts("Relu", ("ReLU",), [], ["crit.vgg.1"], traced=False).place == "foreign_module"
    assert WriterFacts("Relu", ("ReLU",), [], [], traced=False).place == "not_in_model"
    assert WriterFacts("Add", (), [], [], traced=True).place == "not_in_model"
    assert WriterFacts("Add", (), [], [], traced=False).place == "unknown"
    assert set(WRITER_PLACES) == {"only_inplace_module", "foreign_module", "not_in_model"}


def test_the_writer_fix_names_the_module_class_or_the_arithmetic() -> None:
    leaky = WriterFacts("LeakyRelu", ("LeakyReLU",), [], [], traced=True)
    assert leaky.fn == "leaky_relu"
    assert writer_fix(leaky).startswith("run it out of place: nn.LeakyReLU(inplace=False)")
    assert "`x = x + y`" in writer_fix(WriterFacts("Add", (), [], [], traced=True))
    assert "the op without `_`" in writer_fix(WriterFacts("Clamp", (), [], [], traced=True))


def test_untraced_words_say_why_the_place_is_approximate() -> None:
    f = UntracedFacts(op="Sigmoid", before=None, feeds=None, by_type=[], place="outside")
    reason, hint = UNTRACED_WORDS["outside"]
    assert "probably ran after the forward" in reason(f) and "Probably in the loss code" in hint(f)
    custom = UntracedFacts(op="Cube", before=None, feeds=None, by_type=[], place="custom")
    assert UNTRACED_WORDS["custom"][0](custom) == "Cube is a custom autograd.Function, not traced inside a forward"
    assert UNTRACED_WORDS["traced_step"][1](f) == UNTRACED_WORDS["untraced_step"][1](f)


def test_an_inplace_error_carries_its_words_as_an_explanation() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Sigmoid(), nn.ReLU(inplace=True), nn.Linear(8, 1))
    with gradwatch.watch(model, console=False) as gw:
        try:
            model(torch.randn(16, 4)).pow(2).mean().backward()
        except RuntimeError as e:
            f = gw.explain(e)
    assert f is not None and f.kind == "inplace_error" and f.explanation is not None
    assert f.explanation.why == WHY_INPLACE and f.message == f.explanation.render()
    assert f.fix and f.message.endswith("Fix: " + f.fix)
    assert f.fix == "make the op that changes it out of place. " + CULPRITS
