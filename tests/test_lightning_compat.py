"""GradWatchCallback attached to Trainers the way Lightning's own tests build them: gradwatch changes nothing of
Lightning's (its logging, its log directories, copies of the module, its learning-rate finder)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from conftest import lightning_namespace

lightning_namespace("lightning.pytorch")  # skip the module when Lightning is not installed

# -- imports and logging ---------------------------------------------------------------------------
# A fresh process: import the namespaces in ``imports`` (and gradwatch.lightning before or after them), fit a
# tiny model in each namespace's Trainer with the callback, and print what a user would check.
_FIT = textwrap.dedent(
    """
    import importlib, logging, sys, warnings
    warnings.filterwarnings("ignore")
    order = sys.argv[1].split(",")
    for name in order:
        importlib.import_module(name)
    from gradwatch.lightning import GradWatchCallback
    import torch

    class Capture(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    namespaces = [n for n in ("lightning.pytorch", "pytorch_lightning") if n in order]
    for ns_name in namespaces or ["lightning.pytorch"]:
        cb = GradWatchCallback(console=False)  # built before any Lightning import when namespaces is empty
        ns = importlib.import_module(ns_name)
        capture = Capture()
        logging.getLogger(ns_name + ".utilities.rank_zero").addHandler(capture)

        class Tiny(ns.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(4, 1)

            def training_step(self, batch, batch_idx):
                loss = self.layer(batch[0]).pow(2).mean()
                return loss * float("nan") if batch_idx == 1 else loss

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

            def train_dataloader(self):
                data = torch.utils.data.TensorDataset(torch.randn(32, 4))
                return torch.utils.data.DataLoader(data, batch_size=8)

        trainer = ns.Trainer(
            accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
        )
        trainer.fit(Tiny())
        stopped = any("`Trainer.fit` stopped" in m for m in capture.messages)
        kinds = sorted({f.kind for f in cb.findings})
        print(ns_name, "stopped-logged" if stopped else "stopped-missing", ",".join(kinds))
    print("modules", "pytorch_lightning" in sys.modules, "lightning.pytorch" in sys.modules)
    """
)


def _run(order: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", _FIT, order], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip().splitlines()


@pytest.mark.parametrize("gradwatch_first", [False, True])
def test_lightning_pytorch_alone_keeps_its_logger_and_pytorch_lightning_unimported(gradwatch_first: bool) -> None:
    lines = _run("gradwatch,lightning.pytorch" if gradwatch_first else "lightning.pytorch")
    assert lines[0].startswith("lightning.pytorch stopped-logged ") and "nonfinite_loss" in lines[0], lines
    assert lines[-1] == "modules False True"


@pytest.mark.parametrize("gradwatch_first", [False, True])
def test_pytorch_lightning_alone_keeps_its_logger_and_lightning_pytorch_unimported(gradwatch_first: bool) -> None:
    lightning_namespace("pytorch_lightning")
    lines = _run("gradwatch,pytorch_lightning" if gradwatch_first else "pytorch_lightning")
    assert lines[0].startswith("pytorch_lightning stopped-logged ") and "nonfinite_loss" in lines[0], lines
    assert lines[-1] == "modules True False"


def test_both_namespaces_imported_the_callback_works_in_both_trainers() -> None:
    lightning_namespace("pytorch_lightning")
    lines = _run("pytorch_lightning,lightning.pytorch")
    assert [line.split()[0] for line in lines[:2]] == ["lightning.pytorch", "pytorch_lightning"], lines
    assert all("stopped-logged" in line and "nonfinite_loss" in line for line in lines[:2]), lines
    assert lines[-1] == "modules True True"


def test_a_callback_built_before_any_lightning_import_is_a_lightning_pytorch_callback() -> None:
    # The rule: built before any Lightning namespace is imported, the callback imports lightning.pytorch (the
    # namespace Lightning documents) and no other.
    lines = _run("gradwatch")
    assert lines[0].startswith("lightning.pytorch stopped-logged ") and "nonfinite_loss" in lines[0], lines
    assert lines[-1] == "modules False True"
