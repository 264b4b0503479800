"""Which reporters a run writes to: the console, TensorBoard, ``gradwatch.jsonl``.

Built once per engine from the configuration and what the integration hands over (Lightning's own
TensorBoard writer, the directory of another logger). A directory that cannot be written is reported once
and left out: training goes on with the reporters that work.
"""

from __future__ import annotations

from typing import Any

from gradwatch.core.config import Config
from gradwatch.core.failures import GradWatchInternalWarning, safe_warn
from gradwatch.report import Reporters
from gradwatch.report.console import ConsoleReporter
from gradwatch.report.jsonl import JsonlReporter
from gradwatch.report.tensorboard import TensorBoardReporter


def build_reporters(
    config: Config,
    *,
    rank_zero: bool,
    run_id: str,
    tb_writer: Any = None,
    tb_log_dir: str | None = None,
    records_dir: str | None = None,
) -> tuple[Reporters, str | None]:
    """The run's reporters, started, and the directory its records go to (None: console only).

    Args:
        config: Validated configuration (``console``, ``log_dir``, ``rate_limit``, ``tb_flush_every``).
        rank_zero: Whether this process reports: other ranks get a console reporter only.
        run_id: The run of the ``gradwatch.jsonl`` records.
        tb_writer: An existing SummaryWriter to write into (Lightning's logger); else ``config.log_dir``.
        tb_log_dir: The directory of ``tb_writer``, when the integration knows it.
        records_dir: Where ``gradwatch.jsonl`` goes when there is neither ``tb_writer`` nor ``log_dir``.
    """
    reporters = Reporters([])
    log_dir: str | None = None
    unwritable: set[str] = set()
    c = config
    if c.console is not False:
        console = None if c.console is True else c.console
        reporters.add(ConsoleReporter(console, rate_limit=c.rate_limit, rank_zero=rank_zero))
    if not rank_zero:
        return reporters, log_dir
    if tb_writer is not None:
        try:
            reporters.add(TensorBoardReporter(writer=tb_writer, flush_every=c.tb_flush_every))
            log_dir = tb_log_dir or reporters.items[-1].log_dir
        except Exception as exc:  # noqa: BLE001
            _warn_unwritable(unwritable, str(tb_writer), exc)
    elif c.log_dir is not None:
        try:
            reporters.add(TensorBoardReporter(log_dir=c.log_dir, flush_every=c.tb_flush_every))
            log_dir = c.log_dir
        except Exception as exc:  # noqa: BLE001
            _warn_unwritable(unwritable, c.log_dir, exc)
    jsonl_dir = log_dir if tb_writer is not None else c.log_dir or records_dir
    if jsonl_dir is not None:
        try:
            tb = reporters.of_type(TensorBoardReporter)
            files = tb.event_files() if tb is not None else []
            reporters.add(JsonlReporter(jsonl_dir, run=run_id, event_files=files))
            log_dir = jsonl_dir
        except Exception as exc:  # noqa: BLE001
            _warn_unwritable(unwritable, jsonl_dir, exc)
    reporters.call("start")  # run_start in gradwatch.jsonl: where this run's records begin
    return reporters, log_dir


def _warn_unwritable(warned: set[str], where: str, exc: BaseException) -> None:
    if where in warned:
        return  # TensorBoard and gradwatch.jsonl share the directory: one warning is enough
    warned.add(where)
    safe_warn(
        f"gradwatch: cannot write logs to {where!r} ({type(exc).__name__}: {exc}); training continues "
        "with console reporting only. Pass a writable log_dir to get TensorBoard and gradwatch.jsonl.",
        GradWatchInternalWarning,
        stacklevel=5,  # safe_warn, this, build_reporters, Engine.__init__: the integration that built the engine
    )
