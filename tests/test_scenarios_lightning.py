"""Reproductions of real bug reports and common set-ups in Lightning, watched by ``GradWatchCallback``.

Each LightningModule below follows the code of a public report or the Lightning documentation (cited
above the test). The modules are written once as mixins and combined with the ``LightningModule`` of
the namespace under test (``lightning.pytorch`` or ``pytorch_lightning``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import plain_console
from torch import nn

from gradwatch import Finding, GradWatchError

pytest.importorskip("lightning.pytorch")
pytest.importorskip("pytorch_lightning")

from gradwatch.lightning import GradWatchCallback

pytestmark = pytest.mark.usefixtures("no_internal_failures")

NAMESPACES = ("lightning.pytorch", "pytorch_lightning")
NONFINITE = ("nonfinite_grad", "nonfinite_loss")


# -- helpers ---------------------------------------------------------------------------------------
def ns_of(name: str) -> Any:
    return pytest.importorskip(name)


def callback(**config: Any) -> GradWatchCallback:
    config.setdefault("console", plain_console())
    return GradWatchCallback(**config)


def show(findings: list[Finding]) -> str:
    return (
        "\n".join(
            f"  {f.kind}@{f.step} [{f.severity}] op={f.op} module={f.module} params={list(f.params[:4])}"
            for f in findings
        )
        or "  (no findings)"
    )


def of(findings: list[Finding], kind: str) -> list[Finding]:
    return [f for f in findings if f.kind == kind]


def problems(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity in ("warning", "error")]


def trainer(ns: Any, cb: Any, **kwargs: Any) -> Any:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 8,
        "logger": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "enable_progress_bar": False,
        "num_sanity_val_steps": 0,
    }
    options.update(kwargs)
    return ns.Trainer(callbacks=cb if isinstance(cb, list) else [cb], **options)


def loader(n: int = 64, batch_size: int = 8, dim: int = 8, seed: int = 0) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    y = (x[:, :1] > 0).float()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


_BUILT: dict[tuple[str, type], type] = {}


def build(ns: Any, mixin: type, *args: Any, **kwargs: Any) -> Any:
    """Instantiate ``mixin`` as a LightningModule of namespace ``ns``."""
    key = (ns.__name__, mixin)
    if key not in _BUILT:
        _BUILT[key] = type(mixin.__name__, (mixin, ns.LightningModule), {})
    return _BUILT[key](*args, **kwargs)


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


class Snapshots:
    """Mixin part: parameters at the start of every training batch (global step -> snapshot)."""

    snaps: dict[int, dict[str, torch.Tensor]]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.snaps[int(self.trainer.global_step)] = snapshot(self)  # type: ignore[attr-defined,arg-type]


# == GANs and manual optimization ===================================================================
class GANModule(Snapshots):
    """The Lightning basic-GAN recipe: manual optimization, toggle_optimizer, D on fake.detach()."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh())
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
        self.snaps = {}

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], 4)
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)

        self.toggle_optimizer(opt_g)
        fake = self.generator(z)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        d_loss = (
            F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
            + F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), zeros)
        ) / 2
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.Adam(self.generator.parameters(), lr=2e-4, betas=(0.5, 0.999)),
            torch.optim.Adam(self.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999)),
        )

    def train_dataloader(self) -> Any:
        return loader()


# https://github.com/Lightning-AI/pytorch-lightning/issues/17294
@pytest.mark.parametrize("namespace", NAMESPACES)
def test_manual_optimization_gan_with_toggle_optimizer_is_silent(namespace: str) -> None:
    ns = ns_of(namespace)
    cb = callback()
    trainer(ns, cb, max_steps=16).fit(build(ns, GANModule))
    assert problems(cb.findings) == [], show(cb.findings)


class ManualAccumulation(Snapshots):
    """Manual optimization with gradient accumulation, as in the Lightning docs."""

    def __init__(self, zero_grad: bool = True, every: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.zero, self.every = zero_grad, every
        self.snaps = {}

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        loss = F.binary_cross_entropy_with_logits(self.net(x), y) / self.every
        self.manual_backward(loss)
        if (batch_idx + 1) % self.every == 0:
            opt.step()
            if self.zero:
                opt.zero_grad()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> Any:
        return loader()


# https://github.com/Lightning-AI/pytorch-lightning/issues/17957
def test_manual_gradient_accumulation_from_the_docs_is_silent() -> None:
    ns = ns_of("lightning.pytorch")
    cb = callback()
    trainer(ns, cb, max_epochs=1, max_steps=-1).fit(build(ns, ManualAccumulation))
    assert problems(cb.findings) == [], show(cb.findings)


# https://github.com/Lightning-AI/pytorch-lightning/pull/17975
def test_manual_gradient_accumulation_without_zero_grad_is_reported_at_the_second_step() -> None:
    ns = ns_of("lightning.pytorch")
    cb = callback()
    trainer(ns, cb, max_epochs=1, max_steps=-1).fit(build(ns, ManualAccumulation, zero_grad=False))
    f = of(cb.findings, "zero_grad_missing")
    assert f and f[0].step == 1, show(cb.findings)


# == automatic optimization set-ups =================================================================
class Classifier(Snapshots):
    """A small classifier whose training_step can return None, or a NaN loss, on chosen steps."""

    def __init__(
        self,
        skip_every: int = 0,
        nan_at: int | None = None,
        optimizer: str = "sgd",
        hand_log: bool = False,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 3)
        self.skip_every, self.nan_at, self.optimizer_name, self.hand_log = skip_every, nan_at, optimizer, hand_log
        self.snaps = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        if self.skip_every and batch_idx % self.skip_every == 1:
            return None  # "skip this batch": the documented way
        if self.nan_at is not None and self.global_step == self.nan_at:
            x = x * 1e4  # an unnormalised batch
        logits = self(x)
        target = y.long().squeeze(1)
        if self.hand_log:  # a focal-loss style log(softmax) written by hand
            p = torch.softmax(logits, dim=-1).gather(1, target[:, None]).squeeze(1)
            return (-((1 - p) ** 2) * torch.log(p)).mean()
        return F.cross_entropy(logits, target)

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "lbfgs":
            return torch.optim.LBFGS(params, lr=0.5, max_iter=4)
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)

    def train_dataloader(self) -> Any:
        return loader()


# https://github.com/Lightning-AI/pytorch-lightning/issues/3323
def test_training_step_returning_none_to_skip_batches_is_silent() -> None:
    ns = ns_of("lightning.pytorch")
    cb = callback()
    trainer(ns, cb, max_epochs=1, max_steps=-1).fit(build(ns, Classifier, skip_every=2))
    assert problems(cb.findings) == [], show(cb.findings)


# https://github.com/Lightning-AI/pytorch-lightning/issues/13243
@pytest.mark.parametrize("namespace", NAMESPACES)
def test_accumulate_grad_batches_is_silent(namespace: str) -> None:
    ns = ns_of(namespace)
    cb = callback()
    trainer(ns, cb, max_epochs=2, max_steps=-1, accumulate_grad_batches=4).fit(build(ns, Classifier))
    assert cb.findings == [], show(cb.findings)


# https://github.com/Lightning-AI/pytorch-lightning/issues/21435
def test_bf16_mixed_with_gradient_clipping_is_silent() -> None:
    ns = ns_of("lightning.pytorch")
    cb = callback()
    trainer(ns, cb, max_steps=16, precision="bf16-mixed", gradient_clip_val=0.5).fit(build(ns, Classifier))
    assert problems(cb.findings) == [], show(cb.findings)


# https://github.com/clcarwin/sphereface_pytorch/issues/24 (focal loss with a hand-written log)
def test_bf16_mixed_hand_written_focal_loss_nan_is_skipped_and_named() -> None:
    ns = ns_of("lightning.pytorch")
    cb = callback()
    model = build(ns, Classifier, nan_at=3, hand_log=True)
    trainer(ns, cb, max_steps=6, precision="bf16-mixed").fit(model)
    assert not [f for f in cb.findings if f.kind in NONFINITE and f.step != 3], show(cb.findings)
    assert of(cb.findings, "nonfinite_loss") and of(cb.findings, "nonfinite_loss")[0].step == 3, show(cb.findings)
    for name, before in model.snaps[3].items():
        assert torch.equal(before, model.snaps[4][name]), f"{name} changed over the skipped step"
    origin = of(cb.findings, "nan_origin")
    assert origin and origin[0].step == 3 and origin[0].op == "LogBackward0", show(cb.findings)


# https://github.com/Lightning-AI/pytorch-lightning/issues/4083
def test_lbfgs_closure_optimizer_is_silent() -> None:
    ns = ns_of("lightning.pytorch")
    cb = callback()
    trainer(ns, cb, max_steps=6).fit(build(ns, Classifier, optimizer="lbfgs"))
    assert problems(cb.findings) == [], show(cb.findings)


# https://github.com/Lightning-AI/pytorch-lightning/issues/246
def test_lbfgs_nan_step_is_skipped_at_the_right_global_step() -> None:
    ns = ns_of("lightning.pytorch")
    cb = callback()
    model = build(ns, Classifier, optimizer="lbfgs", nan_at=2, hand_log=True)
    trainer(ns, cb, max_steps=5).fit(model)
    nonfinite = [f for f in cb.findings if f.kind in NONFINITE]
    assert nonfinite and {f.step for f in nonfinite} == {2}, show(cb.findings)
    for name, before in model.snaps[2].items():
        assert torch.equal(before, model.snaps[3][name]), f"{name} changed over the skipped LBFGS step"
    assert all(torch.isfinite(p).all() for p in model.parameters())


class GradReadingClassifier(Classifier):
    """Reads a gradient in its own hooks (logging a layer's gradient norm, custom value clipping)."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.log("grad_norm_head", self.head.weight.grad.norm())

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        torch.nn.utils.clip_grad_value_(self.parameters(), 0.5)


# https://github.com/MatteoSalvatori/INCE/issues/6 (clip_grad_value_ raises on parameters without gradients)
@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("module", ["clip_value", "reads_grad"])
def test_skipped_nan_step_with_value_clipping_or_a_hook_reading_grad_does_not_crash(namespace: str, module: str) -> None:
    ns = ns_of(namespace)
    cb = callback()
    if module == "clip_value":
        model = build(ns, Classifier, nan_at=3, hand_log=True)
        options = {"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"}
    else:
        model = build(ns, GradReadingClassifier, nan_at=3, hand_log=True)
        options = {"gradient_clip_val": 0.5}
    trainer(ns, cb, max_steps=6, **options).fit(model)  # a None .grad made these raise
    assert {f.step for f in cb.findings if f.kind in NONFINITE} == {3}, show(cb.findings)
    for name, before in model.snaps[3].items():
        assert torch.equal(before, model.snaps[4][name]), f"{name} changed over the skipped step"
    assert all(torch.isfinite(p).all() for p in model.parameters())


class Boundary(Snapshots):
    """A physics-informed style fit with LBFGS: sqrt(1 - w^2) is NaN (value and gradient) past |w| = 1,
    and the pull towards 1.5 makes LBFGS's iterations within one step cross it."""

    def __init__(self, line_search: str | None) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.0, 0.1]))
        self.line_search = line_search
        self.snaps = {}

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return -torch.sqrt(1 - self.w.pow(2)).sum() * 0.1 + ((self.w - 1.5) ** 2).sum() * 5

    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS([self.w], lr=1.0, max_iter=10, line_search_fn=self.line_search)

    def train_dataloader(self) -> Any:
        return loader()


# https://github.com/Lightning-AI/pytorch-lightning/issues/5953 (LBFGS turns the weights NaN)
@pytest.mark.parametrize("line_search", [None, "strong_wolfe"])
def test_lbfgs_iteration_into_nan_within_a_step_is_reported_at_its_step_and_never_applied(line_search: Any) -> None:
    ns = ns_of("lightning.pytorch")
    cb = callback()
    model = build(ns, Boundary, line_search)
    trainer(ns, cb, max_steps=4).fit(model)
    first = next(f for f in cb.findings if f.kind in NONFINITE)
    assert (first.kind, first.step) == ("nonfinite_loss", 0), show(cb.findings)
    assert first.data["closure_evaluation"] > 1, first.data
    assert torch.isfinite(model.w).all(), model.w


# https://lightning.ai/docs/pytorch/stable/advanced/transfer_learning.html (BackboneFinetuning)
def test_backbone_finetuning_callback_freeze_then_unfreeze_is_silent() -> None:
    ns = ns_of("lightning.pytorch")
    cb = callback()
    finetune = ns.callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=1, verbose=False)
    model = build(ns, Classifier)
    trainer(ns, [finetune, cb], max_epochs=2, max_steps=-1, limit_train_batches=4).fit(model)
    assert all(p.requires_grad for p in model.backbone.parameters())  # it did unfreeze
    assert problems(cb.findings) == [], show(cb.findings)


class Teacher(Snapshots):
    """Mean-teacher style: a frozen EMA copy evaluated under torch.no_grad inside training_step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.teacher = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.teacher.load_state_dict(self.student.state_dict())
        self.teacher.requires_grad_(False)
        self.snaps = {}

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        with torch.no_grad():
            target = torch.sigmoid(self.teacher(x))
        out = self.student(x)
        return F.binary_cross_entropy_with_logits(out, y) + F.mse_loss(torch.sigmoid(out), target)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.student.parameters()):
                t.mul_(0.99).add_(s, alpha=0.01)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.student.parameters(), lr=1e-3)

    def train_dataloader(self) -> Any:
        return loader()


# https://github.com/BINE022/EEGPT/issues/18
def test_frozen_ema_teacher_under_no_grad_inside_training_step_is_silent() -> None:
    ns = ns_of("lightning.pytorch")
    cb = callback()
    trainer(ns, cb, max_steps=16).fit(build(ns, Teacher))
    assert problems(cb.findings) == [], show(cb.findings)


class LazyModule(Snapshots):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.LazyLinear(16), nn.ReLU())
        self.head = nn.LazyLinear(1)
        self.encoder(torch.zeros(1, 8))  # the dry run in __init__, so configure_optimizers sees real shapes
        self.head(torch.zeros(1, 16))
        self.snaps = {}

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.binary_cross_entropy_with_logits(self.head(self.encoder(x)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> Any:
        return loader()


# https://github.com/Lightning-AI/pytorch-lightning/issues/13764
def test_lazy_modules_initialized_by_a_dry_run_are_silent() -> None:
    ns = ns_of("lightning.pytorch")
    cb = callback()
    trainer(ns, cb, max_steps=8).fit(build(ns, LazyModule))
    assert problems(cb.findings) == [], show(cb.findings)


# == autograd errors inside fit =====================================================================
class InplaceGate(Snapshots):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)
        self.gate = nn.Sigmoid()
        self.act = nn.ReLU(inplace=True)
        self.out = nn.Linear(8, 1)
        self.snaps = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.gate(self.fc(x))))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> Any:
        return loader()


# https://github.com/pytorch/pytorch/issues/9391
@pytest.mark.parametrize("namespace", NAMESPACES)
def test_inplace_relu_after_sigmoid_in_fit_names_the_module_and_reraises(namespace: str) -> None:
    ns = ns_of(namespace)
    cb = callback()
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as raised:
        trainer(ns, cb).fit(build(ns, InplaceGate))
    assert type(raised.value) is RuntimeError
    f = of(cb.findings, "inplace_error")
    assert len(f) == 1 and (f[0].step, f[0].op, f[0].module) == (0, "Sigmoid", "gate"), show(cb.findings)


class DetachedLoss(Snapshots):
    """The loss is rebuilt from ``.item()`` for logging and that copy is returned."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.snaps = {}

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = F.binary_cross_entropy_with_logits(self.net(x), y)
        return torch.tensor(loss.item())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> Any:
        return loader()


# https://github.com/ronghuaiyang/arcface-pytorch/issues/56
def test_loss_without_graph_in_fit_is_no_grad_graph_and_reraised() -> None:
    ns = ns_of("lightning.pytorch")
    cb = callback()
    with pytest.raises(RuntimeError, match="does not require grad and does not have a grad_fn") as raised:
        trainer(ns, cb).fit(build(ns, DetachedLoss))
    assert type(raised.value) is RuntimeError
    f = of(cb.findings, "no_grad_graph")
    assert len(f) == 1 and f[0].step == 0, show(cb.findings)


# https://github.com/Lightning-AI/pytorch-lightning/issues/7544 ("skip the NaN batch" done by gradwatch)
def test_raise_policy_stops_fit_with_a_gradwatch_error_naming_the_step() -> None:
    ns = ns_of("lightning.pytorch")
    cb = callback(on_nonfinite="raise")
    with pytest.raises(GradWatchError) as raised:
        trainer(ns, cb).fit(build(ns, Classifier, nan_at=2, hand_log=True))
    assert {f.step for f in raised.value.findings} == {2}
    assert {f.kind for f in raised.value.findings} & set(NONFINITE)


class StepBetweenBackwards(Snapshots):
    """The GAN update order of the 406_GAN tutorial, ported to manual optimization."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1), nn.Sigmoid())
        self.snaps = {}

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, _ = batch
        opt_g, opt_d = self.optimizers()
        prob_fake = self.discriminator(self.generator(torch.randn(real.shape[0], 4)))
        prob_real = self.discriminator(real)
        d_loss = -torch.mean(torch.log(prob_real) + torch.log(1.0 - prob_fake))
        g_loss = torch.mean(torch.log(1.0 - prob_fake))
        opt_d.zero_grad()
        self.manual_backward(d_loss, retain_graph=True)
        opt_d.step()  # changes the discriminator weights g_loss's graph still needs
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.Adam(self.generator.parameters(), lr=1e-4),
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-4),
        )

    def train_dataloader(self) -> Any:
        return loader()


# https://github.com/pytorch/pytorch/issues/39141
def test_manual_gan_discriminator_step_before_generator_backward_names_the_weight() -> None:
    ns = ns_of("lightning.pytorch")
    cb = callback()
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as raised:
        trainer(ns, cb).fit(build(ns, StepBetweenBackwards))
    assert type(raised.value) is RuntimeError
    f = of(cb.findings, "inplace_error")
    assert len(f) == 1, show(cb.findings)
    assert f[0].params and f[0].params[0].startswith("discriminator."), show(f)
    assert "optimizer.step()" in f[0].message


class UnusedBranch(Snapshots):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 1)
        self.aux_head = nn.Linear(16, 4)  # defined in __init__, never used in forward
        self.snaps = {}

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.binary_cross_entropy_with_logits(self.head(self.encoder(x)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> Any:
        return loader()


# https://github.com/ImprintLab/MedSegDiff/issues/27
@pytest.mark.parametrize("namespace", NAMESPACES)
def test_layer_defined_but_unused_in_forward_is_named_once(namespace: str) -> None:
    ns = ns_of(namespace)
    cb = callback()
    trainer(ns, cb).fit(build(ns, UnusedBranch))
    f = of(cb.findings, "none_grad")
    assert len(f) == 1 and f[0].step == 0, show(cb.findings)
    assert set(f[0].params) == {"aux_head.weight", "aux_head.bias"}
    assert problems(cb.findings) == f, show(cb.findings)


class LossRecorder(Snapshots):
    """Records the loss each training_step returns (what the user logs and expects to see)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.returned: list[float] = []
        self.snaps = {}

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = F.binary_cross_entropy_with_logits(self.net(x), y)
        self.returned.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> Any:
        return loader()


# https://github.com/Lightning-AI/pytorch-lightning/issues/13243
def test_logged_loss_under_accumulation_is_not_divided_by_the_accumulation_factor(tmp_path: Any) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ns = ns_of("lightning.pytorch")
    cb = callback()
    logger = ns.loggers.TensorBoardLogger(str(tmp_path), name="run", version=0)
    model = build(ns, LossRecorder)
    trainer(ns, cb, max_steps=4, accumulate_grad_batches=4, logger=logger).fit(model)
    events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("gradwatch/loss")}
    expected = {k: sum(model.returned[4 * k : 4 * k + 4]) / 4 for k in range(4)}
    assert sorted(logged) == [0, 1, 2, 3], logged
    for k in range(4):
        assert logged[k] == pytest.approx(expected[k], rel=1e-5), (logged, expected)


class NanInMicroBatch(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        if batch_idx == 5:
            x = x * 1e4  # the second micro-batch of the second accumulation window
        target = y.long().squeeze(1)
        p = torch.softmax(self(x), dim=-1).gather(1, target[:, None]).squeeze(1)
        return (-((1 - p) ** 2) * torch.log(p)).mean()


# https://github.com/Lightning-AI/pytorch-lightning/issues/19987
def test_nan_in_one_micro_batch_under_accumulate_grad_batches_is_localized() -> None:
    ns = ns_of("lightning.pytorch")
    cb = callback()
    trainer(ns, cb, max_steps=3, accumulate_grad_batches=4).fit(build(ns, NanInMicroBatch))
    assert {f.step for f in cb.findings if f.kind in NONFINITE} == {1}, show(cb.findings)
    origin = of(cb.findings, "nan_origin")
    assert origin and (origin[0].step, origin[0].op) == (1, "LogBackward0"), show(cb.findings)


class ManualGANWithNaN(GANModule):
    """Non-saturating generator loss written as -log(D(G(z))); one batch drives D(G(z)) to exactly 0.
    ``d_first``: the discriminator (listed second) steps first, as in the DCGAN tutorial."""

    def __init__(self, d_first: bool = False) -> None:
        super().__init__()
        self.applied: list[str] = []
        self.d_first = d_first

    def on_fit_start(self) -> None:
        for name, opt in zip(("G", "D"), self.optimizers()):
            opt.optimizer.register_step_post_hook(lambda *_args, _n=name: self.applied.append(_n))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, _ = batch
        opt_g, opt_d = self.optimizers()
        if self.d_first:
            self._d_step(real, opt_d)
        fake = self.generator(torch.randn(real.shape[0], 4))
        p_fake = torch.sigmoid(self.discriminator(fake))
        if batch_idx == 2:
            p_fake = p_fake * 0.0  # the discriminator is certain: D(G(z)) == 0
        g_loss = -torch.log(p_fake).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        if not self.d_first:
            self._d_step(real, opt_d)

    def _d_step(self, real: torch.Tensor, opt_d: Any) -> None:
        d_loss = F.binary_cross_entropy_with_logits(self.discriminator(real), torch.ones(real.shape[0], 1))
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()


# https://github.com/Lightning-AI/pytorch-lightning/issues/6282
@pytest.mark.parametrize("d_first", [False, True])
def test_manual_gan_nan_is_named_and_the_replay_steps_no_optimizer(d_first: bool) -> None:
    ns = ns_of("lightning.pytorch")
    cb = callback()
    model = build(ns, ManualGANWithNaN, d_first)
    trainer(ns, cb, max_steps=10).fit(model)  # 5 batches, 2 optimizer steps each
    g_step = 5 if d_first else 4  # global_step counts both optimizers' steps
    assert {f.step for f in cb.findings if f.kind in NONFINITE} == {g_step}, show(cb.findings)
    origin = of(cb.findings, "nan_origin")
    assert origin and (origin[0].step, origin[0].op) == (g_step, "LogBackward0"), show(cb.findings)
    assert model.applied == (["D", "G"] if d_first else ["G", "D"]) * 5  # each step() ran once, no more
    for name, before in model.snaps[4].items():
        if name.startswith("generator."):
            assert torch.equal(before, model.snaps[6][name]), f"{name} changed over the skipped step"
