"""The facts and words of ``backward_twice``, ``no_grad_graph``, ``nonscalar_backward`` and anomaly mode's
``nan_origin``, as pure functions and tables: which cause speaks, and the words each cause has.
(End-to-end cases are in test_autograd_errors.py and the golden files.)"""

from __future__ import annotations

from gradwatch.core.findings import Explanation
from gradwatch.diagnose.autograd.anomaly import ANOMALY_FIXES, AnomalyFacts, anomaly_cause, anomaly_words
from gradwatch.diagnose.autograd.backward_twice import TWICE_CAUSES, TwiceFacts, twice_data, twice_words
from gradwatch.diagnose.autograd.no_grad_fn import NO_GRAPH_CAUSES, NO_GRAPH_RULES, NoGraphFacts, no_graph_cause
from gradwatch.diagnose.autograd.nonscalar import ORIGINS, NonscalarFacts, nonscalar_words, origin_cause


# -- backward_twice ----------------------------------------------------------------------------------
def test_a_running_total_says_where_the_old_graph_enters_and_that_retain_graph_is_no_fix() -> None:
    f = TwiceFacts(step=4, cause="running_total", earlier_step_nodes=2, enters_at="AddBackward0", module="2",
                   older_module="2", total="acc")
    words = twice_words(f)
    assert words.cause.endswith("without .item()). It enters this step's graph at AddBackward0; the earlier graph "
                                "comes from module 2.")
    assert words.fix.startswith("start the total afresh after each backward() (`acc = 0`")
    assert "retain_graph=True on the earlier backward() would silence the error" in words.fix
    assert twice_data(f) == {"earlier_step_nodes": 2, "cause": "running_total", "enters_at": "AddBackward0",
                             "total": "acc"}


def test_a_state_kept_on_a_module_names_the_attribute_and_reports_a_carried_state() -> None:
    f = TwiceFacts(step=1, cause="state_attribute", earlier_step_nodes=1, enters_at="MulBackward0", module="lif",
                   older_module="fc", states=["lif.mem"])
    words = twice_words(f)
    assert "lif.mem (a recurrent or spiking neuron" in words.cause
    assert "the earlier graph comes from module fc." in words.cause  # the graph's module, not the state's owner
    assert "`self.mem = self.mem.detach()`" in words.fix
    assert twice_data(f)["cause"] == "carried_state" and twice_data(f)["state_attributes"] == ["lif.mem"]


def test_backward_twice_in_one_step_says_nothing_of_earlier_steps() -> None:
    for cause in ("same_step", "backward_in_training_step", "freed_by_other_optimizer"):
        words = twice_words(TwiceFacts(step=0, cause=cause, enters_at="AddmmBackward0", module="gen"))
        assert "It enters this step's graph" not in words.cause and "retain_graph=True on the earlier" not in words.fix
    assert "(from module gen)" in twice_words(TwiceFacts(step=0, cause="freed_by_other_optimizer", module="gen")).cause
    assert set(TWICE_CAUSES) == {"freed_by_other_optimizer", "running_total", "carried_state", "state_attribute",
                                 "same_step", "backward_in_training_step"}


def test_the_cause_comes_before_why_it_matters_in_the_message() -> None:
    text = Explanation("what", why="why", cause="cause", fix="fix").render()
    assert text == "what\nCause: cause\nWhy it matters: why\nFix: fix"
    assert Explanation("what", why="why").render() == "what\nWhy it matters: why"


# -- no_grad_graph -----------------------------------------------------------------------------------
def test_no_graph_rules_pick_the_first_cause_that_fits() -> None:
    assert no_graph_cause(NoGraphFacts(step=0, model_type="Net", trainable=0, inference=True)) == "all_frozen"
    assert no_graph_cause(NoGraphFacts(step=0, model_type="Net", trainable=3, inference=True)) == "inference_mode"
    assert no_graph_cause(NoGraphFacts(step=0, trainable=3, grad_enabled=False)) == "no_grad_backward"
    assert no_graph_cause(NoGraphFacts(step=0, forward_grad=False, optimizer_type="Sam")) == "closure_under_no_grad"
    assert no_graph_cause(NoGraphFacts(step=0, forward_grad=False)) == "forward_under_no_grad"
    assert no_graph_cause(NoGraphFacts(step=0, frozen=["a.weight"])) == "frozen_path"
    assert no_graph_cause(NoGraphFacts(step=0, frozen=["a.weight"], connected=["`h`"])) == "frozen_or_detached"
    assert no_graph_cause(NoGraphFacts(step=0, connected=["`h`"])) == "detached"
    assert [c for c, _ in NO_GRAPH_RULES] == list(NO_GRAPH_CAUSES)


def test_no_graph_words_count_frozen_parameters_and_name_the_tensors_with_a_graph() -> None:
    f = NoGraphFacts(step=0, trainable=2, frozen=["enc.weight", "enc.bias"], connected=["`head_out`"])
    text = NO_GRAPH_CAUSES["frozen_or_detached"](f)
    assert "2 of 4 parameters have requires_grad=False" in text and "`head_out`, which still has a graph" in text
    hint = NO_GRAPH_CAUSES["detached"](NoGraphFacts(step=0, connected=["`a`", "`b`"]))
    assert "still have a graph, so the cut is between them and the loss" in hint
    assert "SAM.step()" in NO_GRAPH_CAUSES["closure_under_no_grad"](NoGraphFacts(step=0, optimizer_type="SAM"))


# -- nonscalar_backward ------------------------------------------------------------------------------
def test_nonscalar_origin_by_how_it_was_found_and_what_was_met() -> None:
    def cause(**kw: object) -> str:
        return origin_cause(NonscalarFacts(step=0, **kw))  # type: ignore[arg-type]

    assert cause(module="fc", exact_chain=True) == "module_output"
    assert cause(module="fc", exact_chain=True, reduced="Sum") == "partial_reduction"
    assert cause(module="fc", exact_chain=True, loss_op="MseLoss") == "loss_none"
    assert cause(module="fc", reduced="Sum", op="Div") == "walked_reduced"
    assert cause(module="fc", loss_op="MseLoss", op="Sub") == "walked_loss_none"
    assert cause(module="fc", op="Sub") == "walked_unreduced"
    assert cause(op="Mul") == "op_output"
    assert cause() == "unknown"
    assert ORIGINS["unknown"](NonscalarFacts(step=0)) == ""


def test_nonscalar_words_name_the_variable_and_the_line() -> None:
    f = NonscalarFacts(step=3, shape=[8], op="MseLoss", module="head", exact_chain=True, loss_op="MseLoss",
                       name="per_sample", source="train.py:12: per_sample.backward()")
    words = nonscalar_words(f)
    assert words.what == (
        "backward() failed at step 3: it was called on a tensor of shape [8], not a scalar, and without a gradient "
        "argument. It is the per-element output of MseLoss (a loss function called with reduction='none') on the "
        "output of module head.\nWhere: backward() on `per_sample` at train.py:12: per_sample.backward()."
    )
    assert words.fix.startswith("reduce it to the loss you mean — `per_sample.mean()`")


# -- anomaly mode's NaN ------------------------------------------------------------------------------
def test_anomaly_fix_by_cause() -> None:
    generic = "the generic fix"
    assert anomaly_cause(float("nan"), generic, generic) == "loss_nonfinite"
    assert anomaly_cause(None, generic, generic) == "carried_inf"
    assert anomaly_cause(None, "clamp the input of sqrt", generic) == "op_rule"
    f = AnomalyFacts(step=2, op="MmBackward0", index=0, cause="carried_inf", op_fix=generic)
    assert ANOMALY_FIXES["carried_inf"](f).startswith("MmBackward0 rarely makes a NaN from finite values")
    words = anomaly_words(AnomalyFacts(step=2, op="SqrtBackward0", index=0, cause="loss_nonfinite", op_fix="x",
                                       loss=float("inf")))
    assert "The loss itself was inf already." in words.what and "SqrtBackward0 only carries it" in words.fix
