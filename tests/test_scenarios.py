"""Reproductions of real bug reports, as a user would meet them in a plain training loop.

Each test rebuilds, on a tiny CPU model, the training code of one public bug report or forum thread
(cited above the test) and asserts what gradwatch must say about it through the public API only:
``gradwatch.watch`` and the fields of :class:`gradwatch.Finding` (kind, step, severity, params, module,
op, data). Healthy patterns that users rely on (accumulation, frozen layers, tied weights, several
optimizers, AMP, clipping, schedules) must produce no warning at all.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import free_port, panels, plain_console
from torch import nn

import gradwatch
from gradwatch import Finding, GradWatchError

pytestmark = pytest.mark.usefixtures("no_internal_failures")

NONFINITE = ("nonfinite_grad", "nonfinite_loss")


# -- helpers ---------------------------------------------------------------------------------------
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
    """Findings a user would have to act on (warnings and errors)."""
    return [f for f in findings if f.severity in ("warning", "error")]


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def unchanged(before: dict[str, torch.Tensor], model: nn.Module) -> bool:
    return all(torch.equal(before[n], p.detach()) for n, p in model.named_parameters())


def batches(n: int, shape: tuple[int, ...] = (8, 8), seed: int = 0) -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield torch.randn(*shape, generator=g)


def watch(model: nn.Module, opt: Any, **config: Any) -> gradwatch.Watcher:
    config.setdefault("console", plain_console())
    return gradwatch.watch(model, opt, **config)


def reference_error(fn: Callable[[], None]) -> BaseException:
    """The exception ``fn`` raises without gradwatch (to compare with the one raised under it)."""
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    raise AssertionError("the reproduction does not raise without gradwatch")


# == NaN and Inf sources ===========================================================================
class ProbHead(nn.Module):
    """Log of softmax probabilities, written by hand instead of log_softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.softmax(self.fc(h), dim=-1))


class SoftmaxClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = ProbHead()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def train_softmax_classifier(
    policy: str, bad_step: int = 3, steps: int = 6
) -> tuple[gradwatch.Watcher, dict[int, Any]]:
    model = SoftmaxClassifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    y = torch.arange(8) % 5
    snaps: dict[int, Any] = {}
    with watch(model, opt, on_nonfinite=policy) as gw:
        for step, x in enumerate(batches(steps)):
            if step == bad_step:
                x = x * 1e4  # an unnormalised batch: softmax underflows to exactly 0 for some classes
            snaps[step] = snapshot(model)
            loss = F.nll_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        snaps[steps] = snapshot(model)
    return gw, snaps


# https://github.com/summerlvsong/Aggregation-Cross-Entropy/issues/2
@pytest.mark.parametrize("policy", ["warn", "skip"])
def test_log_of_softmax_underflow_names_log_op_and_head_module(policy: str) -> None:
    gw, _ = train_softmax_classifier(policy)
    assert not [f for f in gw.findings if f.kind in NONFINITE and f.step < 3], show(gw.findings)
    assert {f.kind for f in gw.findings if f.step == 3} >= {"nonfinite_grad", "nan_origin"}, show(gw.findings)
    origin = of(gw.findings, "nan_origin")
    assert origin and origin[0].step == 3, show(gw.findings)
    assert (origin[0].op, origin[0].module) == ("LogBackward0", "head"), show(origin)


# https://github.com/pytorch/pytorch/issues/795
def test_log_of_softmax_underflow_update_is_skipped_and_training_continues() -> None:
    gw, snaps = train_softmax_classifier("skip")
    for n in snaps[3]:
        assert torch.equal(snaps[3][n], snaps[4][n]), n
    assert not torch.equal(snaps[4]["head.fc.weight"], snaps[6]["head.fc.weight"])  # later steps still train
    assert all(torch.isfinite(p).all() for p in snaps[6].values())
    assert gw.summary().steps_skipped == 1


# https://github.com/pytorch/pytorch/issues/795
def test_log_of_softmax_underflow_is_explained_on_the_console() -> None:
    out = plain_console()
    model = SoftmaxClassifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, opt, console=out):
        for step, x in enumerate(batches(5)):
            loss = F.nll_loss(model(x * (1e4 if step == 3 else 1)), torch.arange(8) % 5)
            opt.zero_grad()
            loss.backward()
            opt.step()
    text = out.file.getvalue()
    assert (["nan_origin", "nonfinite_grad"], 3) in panels(text), text
    assert "LogBackward0" in text and "module head" in text, text
    assert "log_softmax" in text, text  # the usual fix for log(softmax(x))


class Siamese(nn.Module):
    """Contrastive loss on the Euclidean distance of two embeddings."""

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        norm: list[nn.Module] = [nn.BatchNorm1d(16)] if batchnorm else []
        self.embed = nn.Sequential(nn.Linear(8, 16), *norm, nn.Tanh(), nn.Linear(16, 4))
        self.distance = PairDistance()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        u, v = self.embed(torch.cat([a, b])).chunk(2)  # one batch through the shared tower
        return self.distance(u, v)


class PairDistance(nn.Module):
    def forward(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Written out by hand (torch.norm itself has returned a zero subgradient at 0 since the report).
        return torch.sqrt(((u - v) ** 2).sum(dim=1))


# https://github.com/pytorch/pytorch/issues/2421
def test_zero_distance_pair_gives_nan_gradient_with_finite_loss_named_at_the_sqrt() -> None:
    model = Siamese()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    same = torch.tensor([1.0, 0, 1, 0, 1, 0, 1, 0])
    with watch(model, opt) as gw:
        for step, a in enumerate(batches(5)):
            b = torch.randn(8, 8)
            if step == 2:
                b[0] = a[0]  # a positive pair made of the same image twice
            d = model(a, b)
            loss = (same * d.pow(2) + (1 - same) * F.relu(1.0 - d).pow(2)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    at2 = [f for f in gw.findings if f.step == 2]
    assert {f.kind for f in at2} >= {"nonfinite_grad", "nan_origin"}, show(gw.findings)
    assert not of(gw.findings, "nonfinite_loss"), "the loss stays finite: only the gradient is NaN"
    origin = of(at2, "nan_origin")[0]
    assert (origin.op, origin.module) == ("SqrtBackward0", "distance"), show(at2)
    assert origin.data.get("phase") == "backward"


class HandLayerNorm(nn.Module):
    """The LayerNorm of many tutorials: ``gamma * (x - mean) / (sqrt(var) + eps) + beta``."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(d))
        self.beta = nn.Parameter(torch.zeros(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        std = torch.sqrt(x.var(-1, keepdim=True))
        return self.gamma * (x - mean) / (std + self.eps) + self.beta


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16, bias=False)
        self.norm = HandLayerNorm(16)


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = Encoder()
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.encoder.norm(self.encoder.proj(x)))


# https://github.com/keras-team/keras/issues/2960
def test_constant_padding_rows_in_hand_written_layernorm_name_the_sqrt() -> None:
    model = Tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with watch(model, opt) as gw:
        for step, x in enumerate(batches(6, (2, 6, 8))):
            if step == 4:
                x[:, 4:] = 0.0  # a shorter sequence, padded with zero feature vectors
            y = torch.zeros(2, 6, dtype=torch.long)
            loss = F.cross_entropy(model(x).reshape(-1, 3), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    at4 = [f for f in gw.findings if f.step == 4]
    grad = of(at4, "nonfinite_grad")
    assert grad and "encoder.proj.weight" in grad[0].params, show(gw.findings)
    origin = of(at4, "nan_origin")
    assert origin and (origin[0].op, origin[0].module) == ("SqrtBackward0", "encoder.norm"), show(at4)
    assert not of(gw.findings, "nonfinite_loss")


class Detector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.classifier = nn.Sequential(nn.Linear(16, 1), nn.Sigmoid())  # probabilities, not logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.backbone(x)).squeeze(1)


def train_detector_with_hand_written_bce() -> gradwatch.Watcher:
    model = Detector()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    y = torch.tensor([0.0, 1, 0, 1, 0, 1, 0, 1])
    with watch(model, opt) as gw:
        for step, x in enumerate(batches(6)):
            if step in (2, 3):
                x = x * 500  # a shard of unnormalised data: the sigmoid returns exactly 0.0 and 1.0
            p = model(x)
            loss = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return gw


# https://github.com/pytorch/pytorch/issues/49844
def test_hand_written_bce_on_saturated_sigmoid_is_attributed_to_the_loss() -> None:
    gw = train_detector_with_hand_written_bce()
    assert [f.step for f in of(gw.findings, "nonfinite_loss")] == [2, 3], show(gw.findings)
    origin = of(gw.findings, "nan_origin")
    assert origin and origin[0].step == 2, show(gw.findings)
    assert origin[0].data.get("phase") == "loss", origin[0].data.get("phase")


# https://github.com/pytorch/pytorch/issues/24933
def test_hand_written_bce_recurring_in_the_escalation_window_names_the_log() -> None:
    gw = train_detector_with_hand_written_bce()
    at3 = [f for f in of(gw.findings, "nan_origin") if f.step == 3]
    assert at3 and at3[0].op == "LogBackward0", show(gw.findings)


class VAEEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.mu = nn.Linear(16, 4)
        self.logvar = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.fc(x))
        return self.mu(h), self.logvar(h)


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = VAEEncoder()
        self.sampler = Reparameterize()
        self.decoder = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu, logvar = self.encoder(x)
        return self.decoder(self.sampler(mu, logvar)), mu, logvar


class Reparameterize(nn.Module):
    def forward(self, mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
        std = torch.exp(0.5 * logvar)
        return mu + std * torch.randn_like(std)


# https://github.com/chainer/chainer/issues/6168
def test_fp16_vae_exp_overflow_names_exp_in_the_sampler() -> None:
    model = VAE().half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with watch(model, opt) as gw:
        for step, x in enumerate(batches(5)):
            x = x.half()
            if step == 3:
                x = x * 300  # a bright outlier image: logvar far beyond fp16's exp range (~11)
            recon, mu, logvar = model(x)
            kl = -0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())
            loss = F.mse_loss(recon, x) + kl
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [f.kind for f in gw.findings if f.kind in NONFINITE and f.step < 3] == [], show(gw.findings)
    origin = of(gw.findings, "nan_origin")
    assert origin and origin[0].step == 3, show(gw.findings)
    assert (origin[0].op, origin[0].module) == ("ExpBackward0", "sampler"), show(origin)
    assert all(torch.isfinite(p).all() for p in model.parameters())  # "skip" kept the fp16 weights


class CharRNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.RNN(4, 32, nonlinearity="relu", batch_first=True)
        self.out = nn.Linear(32, 4)
        with torch.no_grad():  # a large recurrent init: the spectral radius is well above 1
            self.rnn.weight_hh_l0.copy_(torch.eye(32) * 1.6 + 0.01 * torch.randn(32, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(x)[0][:, -1])


# https://github.com/pytorch/pytorch/issues/2623
def test_exploding_rnn_is_reported_before_the_loss_goes_nan() -> None:
    model = CharRNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model, opt, on_nonfinite="warn") as gw:
        for x in batches(3, (4, 30, 4)):
            loss = F.mse_loss(model(x.abs()), torch.zeros(4, 4))
            opt.zero_grad()
            loss.backward()
            opt.step()
    exploding = of(gw.findings, "exploding_grad")
    assert exploding and exploding[0].step == 0, show(gw.findings)
    first_nonfinite = min((f.step for f in gw.findings if f.kind in NONFINITE), default=math.inf)
    assert exploding[0].step < first_nonfinite
    assert exploding[0].module == "rnn", show(exploding)


class MLP(nn.Module):
    def __init__(self, depth: int = 4, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(8, width), nn.ReLU()]
        for _ in range(depth - 2):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def diverging_sgd(steps: int, gw_config: dict[str, Any] | None) -> tuple[list[float], Any]:
    """Regression on unnormalised features with a learning rate ten times too high."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=g)
    losses: list[float] = []
    gw = watch(model, opt, **gw_config) if gw_config is not None else None
    try:
        for _ in range(steps):
            x = torch.randn(64, 8, generator=g) * 3
            loss = F.mse_loss(model(x), x @ w)
            losses.append(loss.item())
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        if gw is not None:
            gw.close()
    return losses, gw


def first_nonfinite_loss() -> int:
    losses, _ = diverging_sgd(30, None)
    return next(i for i, v in enumerate(losses) if not math.isfinite(v))


# https://github.com/facebookresearch/maskrcnn-benchmark/issues/295
def test_learning_rate_too_high_first_nonfinite_finding_is_at_the_first_nonfinite_loss() -> None:
    bad = first_nonfinite_loss()
    _, gw = diverging_sgd(bad + 1, {"on_nonfinite": "warn"})
    nonfinite = [f for f in gw.findings if f.kind in NONFINITE]
    assert nonfinite and min(f.step for f in nonfinite) == bad, show(gw.findings) + f"\nfirst bad loss: {bad}"


# https://github.com/pavancm/CONTRIQUE/issues/8
def test_learning_rate_too_high_exploding_gradient_is_warned_before_the_nan() -> None:
    bad = first_nonfinite_loss()
    _, gw = diverging_sgd(bad + 1, {"on_nonfinite": "warn"})
    exploding = of(gw.findings, "exploding_grad")
    assert exploding and exploding[0].step < bad, show(gw.findings) + f"\nfirst bad loss: {bad}"


# https://github.com/CharlieDinh/pFedMe/issues/11
def test_learning_rate_too_high_update_ratio_is_warned_when_measured_every_step() -> None:
    bad = first_nonfinite_loss()
    _, gw = diverging_sgd(bad + 1, {"on_nonfinite": "warn", "update_ratio_every": 1})
    high = of(gw.findings, "update_ratio_high")
    assert high and high[0].step < bad, show(gw.findings) + f"\nfirst bad loss: {bad}"
    assert "learning rate" in high[0].message


# https://github.com/EmbarkStudios/emote/issues/20
def test_learning_rate_too_high_under_skip_stops_with_a_report_after_max_skips() -> None:
    bad = first_nonfinite_loss()
    with pytest.raises(GradWatchError) as raised:
        diverging_sgd(bad + 20, {"on_nonfinite": "skip", "max_skips": 5})
    assert raised.value.findings, "the error carries the findings"
    assert "skip" in str(raised.value)


class Block(nn.Module):
    """A residual block written with the in-place add after the activation."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Linear(16, 16)
        self.relu = nn.ReLU()
        self.conv2 = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.conv1(x))
        out = self.relu(self.conv2(out))
        out += identity
        return out


class ResNetish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(8, 16)
        self.layer1 = nn.Sequential(OrderedDict([("0", Block())]))
        self.fc = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layer1(self.stem(x)))


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


# == autograd errors ================================================================================
# https://github.com/pytorch/vision/issues/807
def test_inplace_residual_add_after_relu_names_relu_module_and_reraises_unchanged() -> None:
    expected = reference_error(lambda: ResNetish()(torch.randn(8, 8)).sum().backward())
    model = ResNetish()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError) as raised, watch(model, opt) as gw:
        for x in batches(3):
            plain_step(model, opt, x)
    assert type(raised.value) is RuntimeError and str(raised.value) == str(expected)
    f = of(gw.findings, "inplace_error")
    assert len(f) == 1 and f[0].step == 0, show(gw.findings)
    assert (f[0].op, f[0].module) == ("Relu", "layer1.0.relu"), show(f)
    assert "x += " in f[0].message or "+=" in f[0].message


class GatedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)
        self.gate = nn.Sigmoid()
        self.act = nn.ReLU(inplace=True)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.gate(self.fc(x))))


# https://github.com/pytorch/pytorch/issues/9391
def test_inplace_relu_after_sigmoid_names_the_sigmoid_module() -> None:
    model = GatedHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"), watch(model, opt) as gw:
        for x in batches(3):
            plain_step(model, opt, x)
    f = of(gw.findings, "inplace_error")
    assert len(f) == 1 and (f[0].step, f[0].op, f[0].module) == (0, "Sigmoid", "gate"), show(gw.findings)
    assert "inplace=True" in f[0].message


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.main = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        img = torch.tanh(self.main(z))
        img[:, 0] = 0.0  # blank out the first channel, in place
        return img


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.main = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x)


class GAN(nn.Module):
    def __init__(self, gen: nn.Module | None = None) -> None:
        super().__init__()
        self.G = gen if gen is not None else Generator()
        self.D = Discriminator()


# https://github.com/pytorch/pytorch/issues/9391
def test_index_assignment_on_tanh_output_in_generator_names_the_generator() -> None:
    gan = GAN()
    opt_g = torch.optim.Adam(gan.G.parameters(), lr=2e-4)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"), watch(gan, opt_g) as gw:
        z = torch.randn(8, 4)
        loss = -torch.log(gan.D(gan.G(z))).mean()
        opt_g.zero_grad()
        loss.backward()
        opt_g.step()
    f = of(gw.findings, "inplace_error")
    assert len(f) == 1 and (f[0].op, f[0].module) == ("Tanh", "G"), show(gw.findings)
    assert "x[idx]" in str(f[0].data.get("modified_by")), f[0].data
    assert "img[:, 0] = 0.0" in str(f[0].data.get("modified_at")), f[0].data


class PlainGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.main = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.main(z)


# https://github.com/MorvanZhou/PyTorch-Tutorial/issues/89
def test_gan_discriminator_step_before_generator_backward_names_the_discriminator_weight() -> None:
    gan = GAN(PlainGenerator())
    opt_g = torch.optim.Adam(gan.G.parameters(), lr=1e-4)
    opt_d = torch.optim.Adam(gan.D.parameters(), lr=1e-4)
    real = torch.randn(8, 8)
    with (
        pytest.raises(RuntimeError, match="modified by an inplace operation") as raised,
        watch(gan, [opt_g, opt_d]) as gw,
    ):
        for _ in range(2):
            fake = gan.G(torch.randn(8, 4))
            prob_real, prob_fake = gan.D(real), gan.D(fake)
            d_loss = -torch.mean(torch.log(prob_real) + torch.log(1.0 - prob_fake))
            g_loss = torch.mean(torch.log(1.0 - prob_fake))
            opt_d.zero_grad()
            d_loss.backward(retain_graph=True)
            opt_d.step()
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
    assert type(raised.value) is RuntimeError
    f = of(gw.findings, "inplace_error")
    assert len(f) == 1 and f[0].step == 0, show(gw.findings)
    assert f[0].params and f[0].params[0].startswith("D.main."), show(f)
    assert f[0].module is not None and f[0].module.startswith("D.main."), show(f)
    assert "optimizer.step()" in f[0].message


class LanguageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 8)
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.decoder = nn.Linear(16, 20)

    def forward(self, tokens: torch.Tensor, hidden: Any) -> tuple[torch.Tensor, Any]:
        out, hidden = self.lstm(self.embed(tokens), hidden)
        return self.decoder(out), hidden


# https://discuss.pytorch.org/t/runtimeerror-trying-to-backward-through-the-graph-a-second-time-but-the-buffers-have-already-been-freed-specify-retain-graph-true-when-calling-backward-the-first-time/6795/2
def test_lstm_hidden_state_not_detached_is_backward_twice_at_step_1() -> None:
    model = LanguageModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(0)
    stream = torch.randint(0, 20, (4, 61), generator=g)

    def train(gw: Any = None) -> None:
        hidden = None
        for i in range(3):
            chunk = stream[:, i * 20 : i * 20 + 21]
            logits, hidden = model(chunk[:, :-1], hidden)  # hidden carried over, never detached
            loss = F.cross_entropy(logits.reshape(-1, 20), chunk[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()

    with (
        pytest.raises(RuntimeError, match="backward through the graph a second time") as raised,
        watch(model, opt) as gw,
    ):
        train()
    assert type(raised.value) is RuntimeError
    f = of(gw.findings, "backward_twice")
    assert len(f) == 1 and f[0].step == 1, show(gw.findings)
    assert "detach" in f[0].message and "retain_graph" in f[0].message


# https://discuss.pytorch.org/t/gpu-memory-increase-while-i-wanna-to-backward-with-accumulative-loss/43284
def test_running_total_of_losses_backpropagated_is_backward_twice() -> None:
    model = MLP(depth=3, width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"), watch(model, opt) as gw:
        running = 0.0
        for x in batches(4):
            loss = model(x).pow(2).mean()
            running = running + loss  # meant for logging, but keeps every step's graph alive
            opt.zero_grad()
            running.backward()
            opt.step()
    f = of(gw.findings, "backward_twice")
    assert len(f) == 1 and f[0].step == 1, show(gw.findings)
    assert ".item()" in f[0].message or "detach" in f[0].message


# https://github.com/Lightning-AI/pytorch-lightning/issues/19910
def test_loss_computed_under_no_grad_is_no_grad_graph_and_reraised_unchanged() -> None:
    model = MLP(depth=3, width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        with torch.no_grad():  # copied from the evaluation loop
            loss = F.mse_loss(model(torch.randn(8, 8)), torch.zeros(8, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()

    expected = reference_error(step)
    with pytest.raises(RuntimeError) as raised, watch(model, opt) as gw:
        step()
    assert str(raised.value) == str(expected)
    f = of(gw.findings, "no_grad_graph")
    assert len(f) == 1 and f[0].step == 0, show(gw.findings)
    assert "no_grad" in f[0].message


# https://github.com/speechbrain/speechbrain/issues/735 (`loss = Variable(loss, requires_grad=True)` against
# "element 0 of tensors does not require grad"), https://github.com/Kostis-S-Z/exploring_meta/issues/16
def test_a_loss_rebuilt_from_its_number_is_told_not_to_be_given_requires_grad_by_hand() -> None:
    model = MLP(depth=3, width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    before = snapshot(model)
    with pytest.raises(RuntimeError), watch(model, opt) as gw:
        loss = torch.tensor(F.mse_loss(model(torch.randn(8, 8)), torch.zeros(8, 1)).item())
        loss.backward()
    (f,) = of(gw.findings, "no_grad_graph")
    assert "torch.tensor(loss.item(), requires_grad=True)" in f.fix and "only silences this error" in f.fix
    with watch(model, opt) as gw:  # the usual answer: the error is gone, and nothing trains
        for _ in range(3):
            loss = F.mse_loss(model(torch.randn(8, 8)), torch.zeros(8, 1))
            loss = torch.tensor(loss.item(), requires_grad=True)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [(f.kind, f.step) for f in problems(gw.findings)] == [("no_grads", 0)], show(gw.findings)
    assert "nor rebuilt from a number" in gw.findings[0].fix
    assert unchanged(before, model)


# https://github.com/xxlong0/SparseNeuS/issues/42
def test_unreduced_loss_is_nonscalar_backward_with_the_fix() -> None:
    model = MLP(depth=3, width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion = nn.MSELoss(reduction="none")
    with (
        pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"),
        watch(model, opt) as gw,
    ):
        loss = criterion(model(torch.randn(8, 8)), torch.zeros(8, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    f = of(gw.findings, "nonscalar_backward")
    assert len(f) == 1 and f[0].step == 0, show(gw.findings)
    assert ".mean()" in f[0].message and ".sum()" in f[0].message


class Wide(nn.Module):
    """Two branches; BatchNorm in the first (the bug reports below use CNNs with BatchNorm)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


# https://github.com/pytorch/pytorch/issues/4534
def test_batchnorm_last_batch_of_one_error_passes_through_without_a_finding() -> None:
    model = Wide()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(17, 8)
    with (
        pytest.raises(ValueError, match="Expected more than 1 value per channel when training") as raised,
        watch(model, opt) as gw,
    ):
        for x in data.split(8):  # 8, 8, then a last batch of 1
            plain_step(model, opt, x)
    assert type(raised.value) is ValueError
    assert problems(gw.findings) == [], show(gw.findings)
    assert gw.closed


# == zero_grad and accumulation =====================================================================
# https://theneuralbase.com/pytorch/learn/beginner/optimizer-zero-grad-clearing-old-gradients/
def test_forgotten_zero_grad_reported_at_the_second_step_with_the_parameters() -> None:
    model = MLP(depth=3, width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model, opt) as gw:
        for x in batches(5):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
    f = of(gw.findings, "zero_grad_missing")
    assert f and f[0].step == 1, show(gw.findings)
    assert set(f[0].params) == {n for n, _ in model.named_parameters()}
    assert f[0].data.get("optimizer") == 0
    assert "zero_grad" in f[0].message


# https://velog.io/@rhss10/기본-optimizer.zerograd는-어디에-넣어주어야-할까
def test_zero_grad_between_backward_and_step_is_reported() -> None:
    model = MLP(depth=3, width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    before = snapshot(model)
    with watch(model, opt) as gw:
        for x in batches(3):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.zero_grad()
            opt.step()
    f = of(gw.findings, "grads_cleared_before_step")
    assert f and f[0].step == 0, show(gw.findings)
    assert unchanged(before, model)  # nothing ever trained: the finding is the only clue


# https://github.com/karpathy/nanoGPT/issues/605
@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradient_accumulation_done_right_is_silent(set_to_none: bool) -> None:
    model = MLP(depth=3, width=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accum = 4
    with watch(model, opt) as gw:
        for i, x in enumerate(batches(24)):
            loss = model(x).pow(2).mean() / accum
            gw.observe_loss(loss)
            loss.backward()
            if (i + 1) % accum == 0:
                opt.step()
                opt.zero_grad(set_to_none=set_to_none)
    assert gw.findings == [], show(gw.findings)
    assert gw.summary().steps == 6


# https://github.com/NVIDIA/DeepLearningExamples/issues/1112
def test_gradient_accumulation_without_zero_grad_after_step_is_reported() -> None:
    model = MLP(depth=3, width=16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    accum = 4
    with watch(model, opt) as gw:
        opt.zero_grad()
        for i, x in enumerate(batches(16)):
            (model(x).pow(2).mean() / accum).backward()
            if (i + 1) % accum == 0:
                opt.step()  # zero_grad() only before the loop: every step re-applies old gradients
    f = of(gw.findings, "zero_grad_missing")
    assert f and f[0].step == 1, show(gw.findings)


# https://github.com/karpathy/nanoGPT/issues/605 (nanoGPT accumulates 40 micro-batches per step)
def test_nan_in_an_early_micro_batch_of_a_long_accumulation_is_localized() -> None:
    model = SoftmaxClassifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    y = torch.arange(8) % 5
    with watch(model, opt) as gw:
        for i, x in enumerate(batches(24)):
            if i == 8:
                x = x * 1e4  # first micro-batch of step 1
            (F.nll_loss(model(x), y) / 8).backward()
            if (i + 1) % 8 == 0:
                opt.step()
                opt.zero_grad()
    assert [f.step for f in of(gw.findings, "nonfinite_grad")] == [1], show(gw.findings)
    origin = of(gw.findings, "nan_origin")
    assert origin and (origin[0].step, origin[0].op, origin[0].module) == (1, "LogBackward0", "head"), show(gw.findings)


# https://github.com/facebookresearch/detectron2/issues/1120 ("if flag: loss += output(x)")
def test_auxiliary_branch_used_every_other_step_is_reported_once() -> None:
    class WithAux(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Linear(8, 16)
            self.head = nn.Linear(16, 1)
            self.aux = nn.Linear(16, 1)

        def forward(self, x: torch.Tensor, flag: bool) -> torch.Tensor:
            h = torch.relu(self.body(x))
            loss = self.head(h).pow(2).mean()
            if flag:
                loss = loss + self.aux(h).pow(2).mean()
            return loss

    model = WithAux()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model, opt) as gw:
        for i, x in enumerate(batches(20)):
            loss = model(x, flag=i % 2 == 1)
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = of(gw.findings, "none_grad")
    assert len(f) == 1 and f[0].params == ("aux.weight", "aux.bias"), show(gw.findings)


# https://github.com/qubvel-org/segmentation_models.pytorch/issues/463
def test_real_nan_source_under_grad_scaler_is_warned_as_persistent_overflow() -> None:
    model = SoftmaxClassifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    y = torch.arange(8) % 5
    with watch(model, opt, scaler=scaler) as gw:
        for i, x in enumerate(batches(30)):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x * (1e4 if i >= 5 else 1))  # from step 5 on, every batch hits log(0)
            opt.zero_grad()
            scaler.scale(F.nll_loss(out.float(), y)).backward()
            scaler.step(opt)
            scaler.update()
    persistent = of(gw.findings, "amp_overflow_persistent")
    assert persistent and persistent[0].severity == "warning" and persistent[0].step < 20, show(gw.findings)
    assert not of(gw.findings, "nonfinite_grad"), show(gw.findings)


# == must-not-flag set-ups ==========================================================================
class FineTune(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
        self.classifier = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.backbone(x))


def classify(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(x), (x[:, 0] > 0).long() + (x[:, 1] > 0).long())
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


# https://github.com/BINE022/EEGPT/issues/18
def test_frozen_backbone_with_optimizer_over_all_parameters_is_silent() -> None:
    model = FineTune()
    model.backbone.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    frozen = snapshot(model.backbone)
    with watch(model, opt) as gw:
        for x in batches(30):
            classify(model, opt, x)
    assert problems(gw.findings) == [], show(gw.findings)
    assert unchanged(frozen, model.backbone)


# https://github.com/JIA-Lab-research/PFENet/issues/10
def test_unfrozen_backbone_missing_from_the_optimizer_is_reported_when_it_becomes_trainable() -> None:
    model = FineTune()
    model.backbone.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    with watch(model, opt) as gw:
        for step, x in enumerate(batches(8)):
            if step == 4:
                model.backbone.requires_grad_(True)  # "unfreeze after warm-up", optimizer left as it was
            classify(model, opt, x)
    assert not [f for f in gw.findings if f.step < 4 and f.severity != "info"], show(gw.findings)
    f = of(gw.findings, "not_in_optimizer")
    assert f and f[0].step == 4, show(gw.findings)
    assert set(f[0].params) == {n for n, _ in model.backbone.named_parameters(prefix="backbone")}


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(30, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.lm_head = nn.Linear(16, 30, bias=False)
        self.lm_head.weight = self.embed.weight  # weight tying

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.body(self.embed(tokens)))


# https://github.com/OpenNMT/OpenNMT-py/pull/309
def test_tied_input_and_output_embeddings_are_silent() -> None:
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with watch(model, opt) as gw:
        for _ in range(30):
            tokens = torch.randint(0, 30, (4, 9), generator=g)
            loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, 30), tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert problems(gw.findings) == [], show(gw.findings)


class LazyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.LazyLinear(16)
        self.head = nn.LazyLinear(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.features(x)))


# https://github.com/Lightning-AI/pytorch-lightning/issues/13764
def test_lazy_modules_watched_after_the_dry_run_are_silent() -> None:
    model = LazyNet()
    model(torch.randn(2, 8))  # the documented dry run
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with watch(model, opt) as gw:
        for x in batches(10):
            plain_step(model, opt, x)
    assert problems(gw.findings) == [], show(gw.findings)


# https://github.com/pytorch/pytorch/pull/44538
def test_lazy_modules_watched_before_the_first_forward_are_silent() -> None:
    model = LazyNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # built on uninitialized parameters
    with watch(model, opt) as gw:
        for x in batches(10):
            plain_step(model, opt, x)
    assert problems(gw.findings) == [], show(gw.findings)
    assert model.features.weight.shape == (16, 8)


# https://github.com/pytorch/examples/blob/main/dcgan/main.py (the fix proposed in pytorch/pytorch#39141)
def test_dcgan_loop_with_two_optimizers_is_silent() -> None:
    gan = GAN(PlainGenerator())
    opt_d = torch.optim.Adam(gan.D.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(gan.G.parameters(), lr=2e-4, betas=(0.5, 0.999))
    bce = nn.BCELoss()
    with watch(gan, [opt_d, opt_g]) as gw:
        for real in batches(30):
            ones, zeros = torch.ones(8, 1), torch.zeros(8, 1)
            gan.D.zero_grad()
            err_real = bce(gan.D(real), ones)
            err_real.backward()
            fake = gan.G(torch.randn(8, 4))
            err_fake = bce(gan.D(fake.detach()), zeros)
            err_fake.backward()
            opt_d.step()
            gan.G.zero_grad()
            err_g = bce(gan.D(fake), ones)  # also leaves gradients on D, cleared by D.zero_grad() next time
            err_g.backward()
            opt_g.step()
    assert problems(gw.findings) == [], show(gw.findings)


# https://github.com/pytorch/examples/blob/main/dcgan/main.py (one watcher per network)
def test_dcgan_with_one_watcher_per_network_is_silent() -> None:
    gan = GAN(PlainGenerator())
    opt_d = torch.optim.Adam(gan.D.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(gan.G.parameters(), lr=2e-4, betas=(0.5, 0.999))
    bce = nn.BCELoss()
    with watch(gan.D, opt_d) as gw_d, watch(gan.G, opt_g) as gw_g:
        for real in batches(20):
            gan.D.zero_grad()
            bce(gan.D(real), torch.ones(8, 1)).backward()
            fake = gan.G(torch.randn(8, 4))
            bce(gan.D(fake.detach()), torch.zeros(8, 1)).backward()
            opt_d.step()
            gan.G.zero_grad()
            bce(gan.D(fake), torch.ones(8, 1)).backward()
            opt_g.step()
    assert problems(gw_d.findings) == [] and problems(gw_g.findings) == [], show(gw_d.findings + gw_g.findings)


# https://discuss.pytorch.org/t/what-does-the-backward-function-do/9944/2
def test_validation_under_no_grad_inside_the_training_loop_is_silent() -> None:
    model = Wide()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    val = torch.randn(16, 8)
    with watch(model, opt) as gw:
        for i, x in enumerate(batches(30)):
            plain_step(model, opt, x)
            if i % 10 == 9:
                model.eval()
                with torch.no_grad():
                    model(val).pow(2).mean().item()
                model.train()
    assert problems(gw.findings) == [], show(gw.findings)


# https://github.com/pytorch/pytorch/issues/2421 (the usual work-around: clip_grad_norm_ before step)
def test_clip_grad_norm_with_a_nan_still_names_the_origin_and_skips() -> None:
    model = Siamese()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    before: dict[str, torch.Tensor] = {}
    with watch(model, opt) as gw:
        for step, a in enumerate(batches(4)):
            b = torch.randn(8, 8)
            if step == 2:
                b[0] = a[0]
                before = snapshot(model)
            loss = model(a, b).mean()
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # spreads the one NaN to every gradient
            opt.step()
            if step == 2:
                assert unchanged(before, model)
    origin = of(gw.findings, "nan_origin")
    assert origin and origin[0].step == 2 and origin[0].module == "distance", show(gw.findings)


# https://github.com/Marcovaldong/lstmp.pytorch/issues/2
def test_clip_grad_norm_and_scheduler_on_a_healthy_run_are_silent() -> None:
    model = MLP(depth=4, width=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=40)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=g)
    with watch(model, opt) as gw:
        for _ in range(40):
            x = torch.randn(32, 8, generator=g)
            loss = F.mse_loss(model(x), x @ w)
            gw.observe_loss(loss)
            opt.zero_grad(set_to_none=False)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            opt.step()
            sched.step()
    assert problems(gw.findings) == [], show(gw.findings)


# https://github.com/lightly-ai/lightly-train/pull/653
@pytest.mark.parametrize("hand_scaler", [True, False])
def test_amp_overflow_steps_of_a_grad_scaler_are_not_errors(hand_scaler: bool) -> None:
    model = MLP(depth=3, width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)  # the first steps overflow, as on a GPU
    extra = {"scaler": scaler} if hand_scaler else {}
    with watch(model, opt, **extra) as gw:
        for x in batches(20):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert scaler.get_scale() <= 2.0**16  # overflow steps did happen
    assert problems(gw.findings) == [], show(gw.findings)
    assert not [f for f in gw.findings if f.kind in NONFINITE + ("exploding_grad",)]


# https://github.com/pytorch/pytorch/issues/40932
class SelfAttentionEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        self.self_attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h, _ = self.self_attn(h, h, h, key_padding_mask=pad)
        return self.out(h).mean(1)


def adam_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v.clone() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def train_with_an_empty_sequence() -> tuple[gradwatch.Watcher, bool]:
    model = SelfAttentionEncoder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    kept = False
    with watch(model, opt) as gw:
        for step, x in enumerate(batches(5, (4, 6, 8))):
            pad = torch.zeros(4, 6, dtype=torch.bool)
            pad[:, 5] = True
            if step == 3:
                pad[2] = True  # an empty example: every key of it is padding
            before, state = snapshot(model), adam_state(opt)
            loss = F.mse_loss(model(x, pad), torch.zeros(4, 1))
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 3:  # weights and Adam's moments and step counts untouched by the skipped step
                kept = unchanged(before, model) and all(map(torch.equal, state, adam_state(opt)))
    return gw, kept


# https://github.com/pytorch/pytorch/issues/40932
def test_fully_padded_sequence_in_multihead_attention_names_the_attention_module() -> None:
    gw, kept = train_with_an_empty_sequence()
    assert {f.kind for f in gw.findings if f.step == 3} >= {"nonfinite_loss", "nan_origin"}, show(gw.findings)
    origin = of(gw.findings, "nan_origin")[0]
    assert (origin.step, origin.module, origin.data.get("phase")) == (3, "self_attn", "forward"), show([origin])
    assert kept


# https://github.com/pytorch/pytorch/issues/41508
def test_fully_padded_sequence_in_multihead_attention_names_the_softmax() -> None:
    gw, _ = train_with_an_empty_sequence()
    origin = of(gw.findings, "nan_origin")[0]
    assert origin.op == "SoftmaxBackward0", show([origin]) + f"\nforward_op={origin.data.get('forward_op')}"
    assert "mask" in origin.message  # the fix speaks of the padding mask, not of the learning rate


# https://github.com/thtrieu/darkflow/issues/1059 ("check your labels": NaN in the data)
def test_nan_in_the_dataset_is_blamed_on_the_input_not_the_model() -> None:
    model = Wide()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with watch(model, opt) as gw:
        for step, x in enumerate(batches(5)):
            if step == 1:
                x[3, 2] = float("nan")  # a missing value in one CSV row
            plain_step(model, opt, x)
    f = of(gw.findings, "nonfinite_input")
    assert f and f[0].step == 1, show(gw.findings)
    assert not of(gw.findings, "nan_origin"), show(gw.findings)


# https://github.com/thtrieu/darkflow/issues/1059
def test_nan_in_the_dataset_of_an_mlp_is_blamed_on_the_input() -> None:
    model = MLP(depth=3, width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with watch(model, opt) as gw:
        for step, x in enumerate(batches(5)):
            if step == 1:
                x[3, 2] = float("nan")  # a missing value in one CSV row
            plain_step(model, opt, x)
    f = of(gw.findings, "nonfinite_input")
    assert f and f[0].step == 1, show(gw.findings)
    assert not of(gw.findings, "nan_origin"), show(gw.findings)


class MaskedLM(nn.Module):
    """A causal Transformer encoder that takes its float attention mask as a forward argument (0 / -inf,
    from nn.Transformer.generate_square_subsequent_mask), pooled with a norm: sqrt(0) on an all-zero row."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(8, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.pool = nn.Identity()

    def forward(self, x: torch.Tensor, mask: torch.Tensor, zero: bool = False) -> torch.Tensor:
        h = self.encoder(self.emb(x), mask=mask, is_causal=True)
        d = self.pool(h).pow(2).sum(-1) * (0.0 if zero else 1.0)
        return torch.sqrt(d).mean(1, keepdim=True)


@pytest.mark.parametrize("nan", [True, False])
def test_a_float_attention_mask_given_to_forward_is_not_blamed_as_bad_data(nan: bool) -> None:
    model = MaskedLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mask = nn.Transformer.generate_square_subsequent_mask(6)  # -inf above the diagonal, by design
    g = torch.Generator().manual_seed(0)
    with watch(model, opt) as gw:
        for step in range(4):
            out = model(torch.randn(4, 6, 8, generator=g), mask, zero=nan and step == 2)
            opt.zero_grad()
            F.mse_loss(out, torch.ones(4, 1)).backward()
            opt.step()
    assert not of(gw.findings, "nonfinite_input"), show(gw.findings)
    if not nan:
        assert gw.findings == [], show(gw.findings)
        return
    origin = of(gw.findings, "nan_origin")
    assert origin and (origin[0].step, origin[0].op) == (2, "SqrtBackward0"), show(gw.findings)


class NormBlock(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8, eps=0.0) if kind == "layer" else nn.GroupNorm(2, 8, eps=0.0)
        self.constant_row = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.constant_row:
            h = h * torch.tensor([0.0, 1, 1, 1])[:, None]  # an all-padding sample: a constant row
        return self.norm(h)


@pytest.mark.parametrize("kind", ["layer", "group"])
def test_normalization_with_eps_zero_on_a_constant_row_says_keep_eps(kind: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(NormBlock(kind), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model, opt) as gw:
        for step, x in enumerate(batches(3, shape=(4, 8))):
            model[0].constant_row = step == 1
            plain_step(model, opt, x)
    origin = of(gw.findings, "nan_origin")
    assert origin and (origin[0].step, origin[0].module) == (1, "0.norm"), show(gw.findings)
    assert "Keep eps > 0" in origin[0].message


class HandSoftmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(8, 16)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, -1)
        scores = (q @ k.transpose(1, 2)).masked_fill(pad[:, None, :], float("-inf"))
        scores = scores - scores.max(-1, keepdim=True).values  # hand-written "stable" softmax
        w = scores.exp() / scores.exp().sum(-1, keepdim=True)
        return self.head((w @ x).mean(1))


def test_hand_written_masked_softmax_over_a_fully_masked_row_says_mask_with_finfo_min() -> None:
    torch.manual_seed(0)
    model = HandSoftmax()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    with watch(model, opt) as gw:
        for step in range(3):
            pad = torch.zeros(4, 5, dtype=torch.bool)
            pad[:, 4] = True
            if step == 1:
                pad[2] = True  # an empty sequence in the batch
            opt.zero_grad()
            model(torch.randn(4, 5, 8, generator=g), pad).pow(2).mean().backward()
            opt.step()
    origin = of(gw.findings, "nan_origin")
    assert origin and (origin[0].step, origin[0].op) == (1, "SubBackward0"), show(gw.findings)
    assert "finfo(x.dtype).min" in origin[0].message and "Inf - Inf" in origin[0].message


# https://github.com/facebookresearch/detectron2/issues/1120 (a branch whose loss is only sometimes added)
def test_loss_averaged_over_an_empty_positive_mask_is_attributed_to_the_loss() -> None:
    model = Detector()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, opt) as gw:
        for step, x in enumerate(batches(5)):
            positive = x[:, 0] > 0
            if step == 2:
                positive[:] = False  # a batch without a single positive example
            p = model(x)
            loss = -(torch.log(p + 1e-6) * positive).sum() / positive.sum()  # 0 / 0
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [f.step for f in of(gw.findings, "nonfinite_loss")] == [2], show(gw.findings)
    origin = of(gw.findings, "nan_origin")
    assert origin and origin[0].step == 2 and origin[0].data.get("phase") == "loss", show(gw.findings)
    assert "Div: division by zero" in origin[0].message and "Log: log of 0" in origin[0].message


# https://github.com/pytorch/pytorch/issues/70348 (cross_entropy is NaN when every target is ignored)
def test_every_target_ignored_is_a_nan_loss_with_finite_gradients_and_says_so() -> None:
    model = MLP(depth=2, width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with watch(model, opt) as gw:
        for step, x in enumerate(batches(5)):
            logits = torch.cat([model(x), -model(x)], dim=1)
            target = (x[:, 0] > 0).long()
            if step == 3:
                target[:] = -100  # a batch of padding only: every target is ignore_index
            loss = F.cross_entropy(logits, target, ignore_index=-100)
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    found = of(gw.findings, "nonfinite_loss")
    assert [f.step for f in found] == [3] and not of(gw.findings, "nonfinite_grad"), show(gw.findings)
    assert found[0].data["grads_finite"] is True
    assert "every gradient is finite" in found[0].message and "count.clamp_min(1)" in found[0].message
    assert "makes every gradient of this step NaN" not in found[0].message


# pytorch/pytorch#96567-style report: cross_entropy(label_smoothing=0.1) over logits masked with -inf is Inf
def test_inf_loss_with_finite_gradients_names_label_smoothing_over_masked_logits_not_a_mean_over_zero() -> None:
    model = MLP(depth=2, width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    allowed = torch.tensor([True, False])
    with watch(model, opt) as gw:
        for step, x in enumerate(batches(5)):
            logits = torch.cat([model(x), -model(x)], dim=1)
            if step == 3:
                logits = logits.masked_fill(~allowed, float("-inf"))  # constrained classes, masked with -inf
            loss = F.cross_entropy(logits, torch.zeros(len(x), dtype=torch.long), label_smoothing=0.1)
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    found = of(gw.findings, "nonfinite_loss")
    assert [f.step for f in found] == [3] and not of(gw.findings, "nonfinite_grad"), show(gw.findings)
    assert found[0].data["grads_finite"] is True and math.isinf(found[0].data["loss"])
    assert "label_smoothing" in found[0].message, found[0].message
    # 0/0 and 0 * log(0) make NaN, never Inf: they are not offered as the cause of an Inf loss
    assert "mean over zero elements" not in found[0].message and "xlogy" not in found[0].message


class ZeroEpsRMSNorm(nn.Module):
    """A LLaMA-port RMSNorm with eps=0 (rms_norm_eps left at 0): rsqrt(0) is Inf on an all-zero vector."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * self.weight


# HF transformers / LLaMA ports: RMSNorm with rms_norm_eps=0 goes NaN on a zero (padding) hidden vector
def test_rmsnorm_without_eps_on_a_zero_vector_names_rsqrt_at_zero_not_the_derivative_of_sqrt() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(30, 16, padding_idx=0), ZeroEpsRMSNorm(16), nn.Linear(16, 30))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with watch(model, opt) as gw:
        for step in range(5):
            x = torch.randint(1, 30, (4, 8))
            y = torch.randint(1, 30, (4, 8))
            if step == 3:
                x[0, 6:], y[0, 6:] = 0, -100  # padding: a zero embedding row
            loss = F.cross_entropy(model(x).reshape(-1, 30), y.reshape(-1))
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    (origin,) = of(gw.findings, "nan_origin")
    assert (origin.step, origin.module, origin.op) == (3, "1", "RsqrtBackward0"), show(gw.findings)
    assert "rsqrt(0)" in origin.message and "eps > 0" in origin.message, origin.message
    assert "derivative of sqrt" not in origin.message  # the forward value is Inf already


# open_clip / SimCLR-style reports: a contrastive loss whose temperature anneals to 0 (sim / 0 = +inf logits)
def test_contrastive_loss_with_a_zero_temperature_gives_the_plus_inf_logit_fix_not_only_the_masked_row() -> None:
    torch.manual_seed(0)
    model = MLP(depth=2, width=16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with watch(model, opt, max_skips=None) as gw:
        for step, x in enumerate(batches(8)):
            tau = max(0.0, 0.5 - 0.1 * step)  # reaches 0 at step 5
            z = F.normalize(torch.cat([model(x), model(x + 0.1)], dim=1), dim=1)
            logits = z @ z.T / tau
            loss = F.cross_entropy(logits, torch.arange(len(x)))
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    named = [f for f in of(gw.findings, "nan_origin") if f.op == "LogSoftmaxBackward0"]
    assert named and named[0].step == 6, show(gw.findings)  # escalated after step 5: the op and its line
    assert "temperature" in named[0].message and "tau.clamp_min" in named[0].message, named[0].message


# PaLM z-loss ports (torch.log(torch.exp(logits).sum(-1)) overflowing) next to a plain cross_entropy
@pytest.mark.parametrize("class_weight", [False, True], ids=["no-weight", "inf-weight"])
def test_loss_code_suspects_leave_out_nll_loss_when_it_cannot_make_the_gradient_non_finite(class_weight: bool) -> None:
    torch.manual_seed(0)
    model = MLP(depth=2, width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    weight = torch.tensor([1.0, float("inf")]) if class_weight else None  # 1/count of an absent class
    with watch(model, opt) as gw:
        for step, x in enumerate(batches(5)):
            logits = torch.cat([model(x), -model(x)], dim=1)
            target = (x[:, 0] > 0).long()
            if class_weight:
                loss = F.cross_entropy(logits, target, weight=weight if step == 3 else None)
            else:
                ce = F.cross_entropy(logits, target)
                z = torch.log(torch.exp(logits * (1e4 if step == 3 else 1.0)).sum(-1))  # exp overflow
                loss = ce + 1e-4 * (z**2).mean()
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    (origin,) = [f for f in of(gw.findings, "nan_origin") if f.step == 3]
    assert origin.data["phase"] == "loss", show(gw.findings)
    if class_weight:
        assert origin.data["loss_ops"] == ["NllLossBackward0"] and "class weight" in origin.message
    else:
        # every target ignored makes the loss NaN but its gradient zero: not a suspect for a NaN gradient
        assert "NllLossBackward0" not in origin.data["loss_ops"] and "ExpBackward0" in origin.data["loss_ops"]
        assert "ignore_index" not in origin.message, origin.message


class LogMaskPool(nn.Module):
    """Log-sum-exp pooling over a padded sequence with an additive log-mask (0 or -inf)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.enc(x) + torch.log(mask.float())[..., None]  # -inf on padding, on every step
        pooled = torch.logsumexp(h, dim=1)
        return self.head(torch.where(mask.any(1, keepdim=True), pooled, torch.zeros_like(pooled)))


# https://github.com/pytorch/pytorch/issues/31829 (logsumexp of an all -inf row: NaN gradient)
def test_logsumexp_over_an_empty_sequence_is_named_not_the_mask_that_is_there_every_step() -> None:
    model = LogMaskPool()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with watch(model, opt) as gw:
        for step in range(6):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 5, 4, generator=g), torch.randn(4, 1, generator=g)
            mask = torch.ones(4, 5, dtype=torch.bool)
            mask[:, 3:] = False
            if step == 3:
                mask[2] = False  # a sequence that is all padding
            opt.zero_grad()
            F.mse_loss(model(x, mask), y).backward()
            opt.step()
    origin = of(gw.findings, "nan_origin")
    assert origin and (origin[0].step, origin[0].op) == (3, "LogsumexpBackward0"), show(gw.findings)
    assert "fully masked row" in origin[0].message


class BatchStandardize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        return self.head(torch.relu((h - h.mean(0)) / (h.std(0) + 1e-5)))


# https://github.com/pytorch/pytorch/issues/4320 (std of one element is NaN: the last batch of size 1)
def test_std_over_a_last_batch_of_one_is_named_with_its_fix() -> None:
    model = BatchStandardize()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with watch(model, opt) as gw:
        for step in range(5):
            g = torch.Generator().manual_seed(step)
            n = 1 if step == 3 else 6
            opt.zero_grad()
            F.mse_loss(model(torch.randn(n, 4, generator=g)), torch.randn(n, 1, generator=g)).backward()
            opt.step()
    origin = of(gw.findings, "nan_origin")
    assert origin and (origin[0].step, origin[0].op) == (3, "StdBackward0"), show(gw.findings)
    assert "drop_last=True" in origin[0].message


class SwitchMoE(nn.Module):
    """Top-1 routing over 4 experts: an expert that gets no token in a batch gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(8, 4)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.softmax(self.router(x), dim=-1)
        choice = gate.argmax(dim=-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            picked = choice == i
            if picked.any():  # empty experts are skipped, as in every MoE implementation
                out[picked] = expert(x[picked]) * gate[picked, i : i + 1]
        return self.head(out)


# https://github.com/lucidrains/mixture-of-experts/issues/7 (experts without tokens get no gradient)
def test_mixture_of_experts_with_experts_idle_on_some_batches_is_silent() -> None:
    model = SwitchMoE()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with watch(model, opt) as gw:
        for step, x in enumerate(batches(40, shape=(6, 8))):
            opt.zero_grad()
            if step == 0:
                x = x[[0] * 6]  # ... but one expert only on the first batch
            model(x).pow(2).mean().backward()
            opt.step()
    # Experts idle on the first batch and on later ones: used on some steps, never reported.
    assert of(gw.findings, "none_grad") == [], show(gw.findings)


def test_mixture_of_experts_with_an_expert_never_routed_to_is_reported_after_its_grace() -> None:
    model = SwitchMoE()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with torch.no_grad():
        model.router.bias[3] = -1e4  # expert 3 never wins the routing: dead from the start
    with watch(model, opt) as gw:
        for x in batches(40, shape=(6, 8)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    unused = of(gw.findings, "none_grad")
    # 4 experts: max(20, 8 per member) = 32 checked steps of grace
    assert [(f.step, f.params) for f in unused] == [(32, ("experts.3.weight", "experts.3.bias"))], show(gw.findings)
    assert "since step 0" in unused[0].message


# https://github.com/pytorch/pytorch/issues/4534 (BatchNorm statistics must survive gradwatch's replay)
def test_batchnorm_running_statistics_are_those_of_the_users_own_forwards() -> None:
    def run(with_gradwatch: bool) -> nn.Module:
        model = Siamese(batchnorm=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        gw = watch(model, opt) if with_gradwatch else None
        for step, a in enumerate(batches(5)):
            b = torch.randn(8, 8, generator=torch.Generator().manual_seed(100 + step))
            if step == 2:
                b[0] = a[0]  # NaN gradient, finite forward: BatchNorm statistics stay finite
            opt.zero_grad()
            model(a, b).mean().backward()
            if with_gradwatch or step != 2:  # the reference skips the bad update by hand
                opt.step()
        if gw is not None:
            assert of(gw.findings, "nan_origin"), show(gw.findings)
            gw.close()
        return model

    ref, watched = run(False), run(True)
    bn_ref, bn = ref.embed[1], watched.embed[1]
    assert int(bn.num_batches_tracked) == int(bn_ref.num_batches_tracked) == 5
    assert torch.equal(bn.running_mean, bn_ref.running_mean)
    assert torch.equal(bn.running_var, bn_ref.running_var)
    assert unchanged(snapshot(ref), watched)


# == distributed ====================================================================================
DDP_WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    from torch import nn
    import gradwatch
    from rich.console import Console
    import io

    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk = nn.Linear(8, 8)
            self.aux_head = nn.Linear(8, 2)  # only used by a loss that was switched off
            self.head = nn.Linear(8, 1)
        def forward(self, x):
            return self.head(torch.relu(self.trunk(x)))

    model = nn.parallel.DistributedDataParallel(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    result = {"error": None}
    gw = gradwatch.watch(model, opt, console=Console(file=io.StringIO()))
    try:
        for step in range(3):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    except RuntimeError as exc:
        result["error"] = str(exc)
    finally:
        gw.close()
    result["findings"] = [f.to_dict() for f in gw.findings]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    if result["error"]:
        # After a DDP reduction error the reducer still holds gloo work, and torch's own teardown of the
        # process group can then abort the process ("terminate called without an active exception",
        # pytorch/pytorch#190489, #179291). The results are written: leave without that teardown.
        sys.stdout.flush()
        os._exit(0)
    dist.destroy_process_group()
    """
)


# https://github.com/ImprintLab/MedSegDiff/issues/27
@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="gloo")
def test_ddp_unused_parameter_is_named_before_the_reduction_error(tmp_path: Any) -> None:
    import json

    script = tmp_path / "worker.py"
    script.write_text(DDP_WORKER)
    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), port, str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=90)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["error"] and "Expected to have finished reduction" in result["error"], result
        unused = [f for f in result["findings"] if f["kind"] == "none_grad"]
        assert unused and unused[0]["step"] == 0, result["findings"]
        assert {p.split("module.")[-1] for p in unused[0]["params"]} == {"aux_head.weight", "aux_head.bias"}


def test_nan_target_in_a_plain_loop_is_blamed_on_the_data() -> None:
    # A regression target with a missing value (a NaN read from a CSV) in one batch; the inputs are clean.
    # The plain loop checked only the model's arguments: the report said "born in the loss computation"
    # with a NaN target as the last of five guesses. Lightning checks the whole batch; the loop's frame
    # holds the target here.
    torch.manual_seed(0)
    X = torch.randn(64, 5)
    Y = X.sum(1, keepdim=True)
    Y[37] = float("nan")  # batch 4
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=8)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with gradwatch.watch(model, opt, console=False) as gw:
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    (f,) = [f for f in gw.findings if f.kind == "nonfinite_input"]
    assert f.step == 4 and f.data["source"] == "loop"
    assert [(i["input"].split(" ")[0], i["nan"]) for i in f.data["inputs"]] == [("y", 1)]
    assert "test_scenarios.py" in f.data["inputs"][0]["input"]  # where the loop holds it
    assert all(p.isfinite().all() for p in model.parameters())


def test_a_nan_born_in_the_loss_is_not_blamed_on_a_dataset_tensor_the_loop_holds() -> None:
    # Must not flag: the loop also holds the whole dataset, which has a NaN in a row no batch uses here;
    # the NaN of this step is log(0) in the loss. Only tensors with the batch's first dimension count.
    torch.manual_seed(0)
    data = torch.randn(64, 5)
    data[60, 0] = float("nan")
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(4):
            x = data[8 * step : 8 * step + 8]
            p = torch.sigmoid(model(x)) * (0.0 if step == 2 else 1.0)
            loss = -torch.log(p).mean()
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert any(f.kind == "nan_origin" and f.step == 2 for f in gw.findings)
    assert not any(f.kind == "nonfinite_input" for f in gw.findings)


def test_spectral_norm_critic_with_a_wasserstein_loss_is_not_a_dead_layer() -> None:
    # Must not flag: SN-WGAN critics built with torch.nn.utils.parametrizations.spectral_norm (the current
    # API). D(fake).mean() - D(real).mean() gives the last bias an exactly zero gradient by construction;
    # the parametrization moved the weight under "4.parametrizations.weight", so the bias was judged as a
    # layer of its own and reported dead. With the old hook-based spectral_norm the run was silent.
    from torch.nn.utils.parametrizations import spectral_norm

    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    D = nn.Sequential(
        spectral_norm(nn.Linear(2, 32)), nn.LeakyReLU(0.1), spectral_norm(nn.Linear(32, 32)), nn.LeakyReLU(0.1),
        spectral_norm(nn.Linear(32, 1)),
    )
    opt_g = torch.optim.Adam(G.parameters(), lr=1e-4, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-4, betas=(0.5, 0.9))
    with gradwatch.watch(D, opt_d, console=False) as gw:
        for it in range(60):
            real = torch.randn(32, 2) * 0.2 + 1.0
            d_loss = D(G(torch.randn(32, 8)).detach()).mean() - D(real).mean()
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            if it % 5 == 4:
                g_loss = -D(G(torch.randn(32, 8))).mean()
                opt_g.zero_grad()
                g_loss.backward()
                opt_g.step()
    assert [f for f in gw.findings if f.severity != "info"] == []
    layers = gw.engine.history.last[0].layer_norms
    assert "4" in layers and not any("parametrizations" in k for k in layers)


def test_a_gradient_dropped_on_purpose_for_the_first_epoch_is_not_none_grad() -> None:
    # Must not flag: DINO's utils.cancel_gradients_last_layer sets the last layer's p.grad = None for the
    # whole first epoch (facebookresearch/dino). Backward reached the layer; the training code dropped its
    # gradient. It was reported at step 0 as "got no gradient: use it in forward or freeze it".
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    last = model[2]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(30):
            loss = model(torch.randn(16, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if step < 20:  # the "first epoch"
                for p in last.parameters():
                    p.grad = None
            opt.step()
    assert not any(f.kind == "none_grad" for f in gw.findings)


def test_a_parameter_the_graph_never_reaches_is_still_none_grad() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(8, 4), nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=False) as gw:
        for _ in range(3):
            loss = model(torch.randn(16, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    (f,) = [f for f in gw.findings if f.kind == "none_grad"]
    assert f.step == 0 and set(f.params) == {"unused.weight", "unused.bias"}


class _EMACodebook(nn.Module):
    """zalandoresearch/pytorch-vq-vae's VectorQuantizerEMA: forward re-assigns its codebook as new
    nn.Parameter objects every training step (an EMA update; the codebook gets no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self._embedding = nn.Embedding(16, 8)
        self._ema_w = nn.Parameter(torch.randn(16, 8))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        distances = torch.cdist(z, self._embedding.weight)
        codes = torch.zeros(z.shape[0], 16).scatter_(1, distances.argmin(1, keepdim=True), 1)
        quantized = codes @ self._embedding.weight
        if self.training:
            self._ema_w = nn.Parameter(self._ema_w * 0.99 + 0.01 * (codes.t() @ z))
            self._embedding.weight = nn.Parameter(self._ema_w / (codes.sum(0, keepdim=True).t() + 1.0))
        return z + (quantized - z).detach()


def test_an_ema_codebook_reassigned_in_forward_is_not_foreign_params() -> None:
    # Must not flag: the optimizer still holds the codebook tensors the model replaced; it said "holds 2
    # parameters the watched model does not own ... so this model never trains".
    torch.manual_seed(0)
    model = nn.ModuleDict({"enc": nn.Linear(32, 8), "vq": _EMACodebook(), "dec": nn.Linear(8, 32)})
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, console=False) as gw:
        for _ in range(10):
            x = torch.randn(16, 32)
            loss = F.mse_loss(model["dec"](model["vq"](model["enc"](x))), x)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [f.kind for f in gw.findings if f.severity != "info"] == []


def test_a_large_embedding_table_is_not_vanishing() -> None:
    # Must not flag: a DLRM-style recommender with a large user table (sparse=True, SGD). A batch reaches a
    # few of its rows, so its gradient relative to the whole table's weights is tiny by construction:
    # it was reported as a vanishing layer, with a fix about activations and init.
    torch.manual_seed(0)

    class Rec(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.user = nn.Embedding(1_000_000, 8, sparse=True)
            self.item = nn.Embedding(500, 8, sparse=True)
            self.mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
            return self.mlp(torch.cat([self.user(u), self.item(i)], 1)).squeeze(1)

    model = Rec()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    item_factor = torch.randn(500)
    with gradwatch.watch(model, opt, console=False, window=20, update_ratio_every=5) as gw:
        for _ in range(60):
            u, i = torch.randint(0, 1_000_000, (64,)), torch.randint(0, 500, (64,))
            y = torch.bernoulli(torch.sigmoid(item_factor[i]))
            loss = F.binary_cross_entropy_with_logits(model(u, i), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert not any(f.kind == "vanishing_grad" for f in gw.findings), [f.message for f in gw.findings]


def test_an_auxiliary_head_whose_output_the_loss_ignores_is_still_none_grad() -> None:
    # The model returns (logits, aux); the loss uses logits only. The aux head is in the outputs' graph
    # but backward never reaches it: it is unused, not a gradient dropped on purpose.
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head, self.aux = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 2)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = torch.relu(self.body(x))
            return self.head(h), self.aux(h)

    torch.manual_seed(0)
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=False) as gw:
        for _ in range(3):
            logits, _aux = model(torch.randn(16, 8))
            loss = logits.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    (f,) = [f for f in gw.findings if f.kind == "none_grad"]
    assert f.step == 0 and set(f.params) == {"aux.weight", "aux.bias"}


def test_nan_padding_masked_out_by_design_is_only_a_hedged_note_next_to_the_origin() -> None:
    # Targets padded with NaN by design, removed with torch.where before the loss; the NaN of step 2 is
    # log(var) with var underflowing to 0 in a Gaussian NLL. "The data is the cause" (an error) sent the user
    # the wrong way: the loop's tensor is now a warning that points at the origin.
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(3):
            x, y = torch.randn(8, 4), torch.randn(8)
            y[-2:] = float("nan")  # padding
            mean, raw = model(x).unbind(1)
            var = torch.exp(raw - (1e4 if step == 2 else 0.0))
            target = torch.where(torch.isfinite(y), y, 0.0)
            loss = (torch.log(var) + (target - mean) ** 2 / var)[:6].mean()
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    kinds = {(f.kind, f.severity) for f in gw.findings if f.step == 2}
    assert ("nan_origin", "error") in kinds and ("nonfinite_input", "error") not in kinds


def test_an_attention_bias_with_minus_inf_padding_is_not_bad_data() -> None:
    # An ALiBi-style distance bias (finite, non-zero) plus -inf key padding, passed to forward: only masks of
    # zeros and -inf were recognized, so a NaN born in the loss was blamed on the data, with no origin.
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)

        def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            a = (self.q(x) @ self.k(x).transpose(1, 2) + bias).softmax(-1)
            return self.out(a @ x).mean(1)

    torch.manual_seed(0)
    model = Attn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(3):
            x, y = torch.randn(8, 5, 4), torch.randint(0, 3, (8,))
            pad = torch.arange(5)[None, :] >= torch.randint(2, 6, (8,))[:, None]
            dist = (torch.arange(5)[None, :] - torch.arange(5)[:, None]).abs().float()
            bias = (-0.5 * dist)[None].expand(8, 5, 5).masked_fill(pad[:, None, :], float("-inf"))
            p = (model(x, bias) * (1e4 if step == 2 else 1.0)).softmax(-1)
            loss = -torch.log(p[torch.arange(8), y]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert not any(f.kind == "nonfinite_input" for f in gw.findings)
    (origin,) = [f for f in gw.findings if f.kind == "nan_origin"]
    assert origin.step == 2 and "born in the loss computation" in origin.message  # the mask's -inf is absorbed


class _CountNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mlp = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


# Log-transformed count features with a zero count (log(0) = -inf; log1p meant): the -inf-only input was
# taken for an attention mask, and a Linear of the model was blamed ("lower the learning rate, clip").
@pytest.mark.parametrize("window", [False, True])
def test_a_minus_inf_feature_that_no_mask_op_absorbs_is_bad_data(window: bool) -> None:
    model = _CountNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    bad = (3, 5) if window else (3,)  # 5: inside the escalation window opened at step 3
    with watch(model, opt, on_nonfinite="skip") as gw:
        for step in range(7):
            counts = torch.randint(1, 50, (16, 5), generator=g).float()
            if step in bad:
                counts[7, 2] = 0
            loss = F.mse_loss(model(torch.log(counts)), counts.sum(1, keepdim=True).log1p())
            opt.zero_grad()
            loss.backward()
            opt.step()
    found = of(gw.findings, "nonfinite_input")
    assert [f.step for f in found] == list(bad), show(gw.findings)
    assert "log1p" in found[0].message and "module mlp.0" in found[0].message, found[0].message
    assert not of(gw.findings, "nan_origin"), show(gw.findings)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_fully_masked_row_of_an_additive_mask_input_is_the_softmax_not_bad_data() -> None:
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.q, self.k, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            a = (self.q(x) @ self.k(x).transpose(1, 2) + mask).softmax(-1)
            return self.out(a @ x).mean(1)

    model = Attn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, opt) as gw:
        for step in range(3):
            x, y = torch.randn(8, 5, 4), torch.randint(0, 3, (8,))
            lens = torch.randint(2, 6, (8,))
            if step == 2:
                lens[1] = 0  # an empty sequence: every key of its rows masked
            mask = torch.zeros(8, 5, 5).masked_fill((torch.arange(5)[None, :] >= lens[:, None])[:, None, :], float("-inf"))
            loss = F.cross_entropy(model(x, mask), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert not of(gw.findings, "nonfinite_input"), show(gw.findings)
    origin = of(gw.findings, "nan_origin")
    assert origin and origin[0].step == 2 and "Softmax" in origin[0].op, show(gw.findings)


# model.half() with mse_loss on targets in natural units (prices of a few hundred): the squared error
# overflows float16's 65504 while the gradients stay finite; gradwatch blamed a mean over zero elements.
def test_a_float16_loss_that_overflows_says_float16_and_to_compute_the_loss_in_float32() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 32), nn.ReLU(), nn.Linear(32, 1)).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(3)
    with watch(model, opt, on_nonfinite="skip") as gw:
        for step in range(8):
            x = torch.randn(16, 5, generator=g).half()
            y = (torch.rand(16, 1, generator=g) * (400 if step == 5 else 100)).half()
            loss = F.mse_loss(model(x), y)
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    (f,) = of(gw.findings, "nonfinite_loss")
    assert f.step == 5 and f.data["float16_overflow"], show(gw.findings)
    assert "65504" in f.message and "out.float()" in f.message and "mean over zero" not in f.message


# A learning-rate typo (SGD lr=2 on unnormalized features): a finite gradient 2e7x the weights' norm is
# applied at step 1 with only an exploding_grad warning leading with clipping; the weights overflow later and
# the nonfinite findings and too_many_skips said "see the first nonfinite finding" with no link back to it.
def test_nonfinite_steps_after_an_applied_explosion_name_it_and_a_typo_lr_leads_the_fix() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=2.0)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(GradWatchError), watch(model, opt, on_nonfinite="skip", max_skips=3) as gw:
        for _ in range(30):
            x = torch.rand(32, 4, generator=g) * 10
            loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    (boom,) = of(gw.findings, "exploding_grad")
    assert boom.data["huge_lr"] == 2.0 and "Fix: lower the learning rate first: lr=2 (SGD)" in boom.message
    bad = of(gw.findings, "nonfinite_grad")
    assert bad and all(f.data["after_exploding"] for f in bad), show(gw.findings)
    assert f"exploding gradient of step {boom.step}" in bad[0].message
    (stop,) = of(gw.findings, "too_many_skips")
    assert stop.data["after_exploding"] == boom.step and f"step {boom.step}" in stop.message


def test_a_usual_learning_rate_does_not_lead_the_exploding_fix() -> None:
    torch.manual_seed(0)
    model = nn.RNN(2, 32, nonlinearity="relu", batch_first=True)
    with torch.no_grad():
        model.weight_hh_l0.copy_(torch.eye(32) * 1.2)  # an IRNN init gone wrong: the gradient explodes
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with watch(model, opt, on_nonfinite="skip", max_skips=None) as gw:
        for _ in range(3):
            x = torch.rand(16, 100, 2, generator=g)
            loss = model(x)[0][:, -1].pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    boom = of(gw.findings, "exploding_grad")
    assert boom and "huge_lr" not in boom[0].data and "Fix: clip gradients" in boom[0].message, show(gw.findings)
    assert all(f.data["after_exploding"] for f in of(gw.findings, "nonfinite_grad") if f.step > boom[0].step)
