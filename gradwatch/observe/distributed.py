"""Many processes (DDP, FSDP, any ``torch.distributed`` job): one decision for all ranks.

When ``torch.distributed`` is initialized with more than one process, :class:`RankAgreement` is
attached to the engine (for the plain loop and for Lightning). On every checked step it runs exactly
one ``all_reduce`` (SUM) of a small vector, queued with the step's statistics and read back with the
step's one device-to-host sync:

- ``[0:world]``: a one-hot flag per rank, 1 when that rank saw a NaN/Inf gradient or loss. Every rank
  learns the same set, so every rank takes the same action on the same step ("skip" on all, "raise"
  on all) and the replicas never diverge. Every rank runs the same collective on every checked step
  (step counters agree across ranks, so ``every=N`` selects the same steps), so a problem on one rank
  cannot leave the others waiting.
- ``[world:]``: for sharded gradients (``DTensor``, e.g. FSDP2's ``fully_shard``), the squared norm of
  this rank's shard, so the reported norm of a sharded parameter is the norm over all its shards.

On the rare step where some rank saw a non-finite value, the ranks also exchange a short description
of what each saw (one ``all_gather_object``), so the report written by rank zero can name the
parameters of another rank. Only rank zero writes the console, TensorBoard and ``gradwatch.jsonl``;
every finding carries ``data["rank"]``, and non-finite findings ``data["ranks"]``.

Under DDP the gradients are averaged across ranks before the optimizer step, so a NaN on one rank
usually reaches every rank; the agreement matters when it does not (losses, gradients that DDP does
not reduce, FSDP shards, ``no_sync`` accumulation, hand-written reductions), and for ``"raise"``. When
the NaN/Inf reached this rank from another one, the exchange also carries whether each rank's input
batch held NaN/Inf (read on the incident only), so rank zero names the rank whose data was the cause.

Uneven inputs (``with ddp_model.join():``, or any ``torch.distributed.algorithms.Join`` over the watched
DDP module or optimizer): ranks make different numbers of optimizer steps, and the join context only
shadows the collectives of its joinables, not gradwatch's. From the first checked step inside such a
context on, gradwatch runs no collective of its own (for the rest of the run: afterwards the ranks'
step counters differ, so ``every=N`` would no longer select the same steps) and every rank decides
alone. DDP's all-reduce makes the gradients identical across ranks, so a decision on them still agrees.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import torch

from gradwatch.core.failures import internal_warning, safe_warn
from gradwatch.core.findings import Finding, GradWatchError
from gradwatch.core.stats import StepStats, layer_key, layer_norms, total_norm
from gradwatch.observe.ddp_reduction import unreduced_facts, unused_finding
from gradwatch.observe.module_hooks import owned
from gradwatch.observe.rank_findings import (
    origin_summary,
    origin_to_relay,
    other_rank_dropped_finding,
    other_rank_finding,
    other_rank_input_finding,
    own_origin,
    relayed_finding,
    skipped_step_finding,
)
from gradwatch.observe.replicas import REPLICA_CHECK_EVERY, diverged_facts, diverged_finding, gather_signatures
from gradwatch.observe.skipped_step import (
    backward_left_unstepped,
    ddp_synced,
    mark_probe,
    probing_ranks,
    ranks_that_saw_values,
    under_fp16_autocast,
    without_probes,
)

NONFINITE_KINDS = ("nonfinite_grad", "nonfinite_loss", "nonfinite_on_other_rank")

#: Seconds the first checked step waits for every rank of the group to have a watcher (each announces
#: itself in the process group's key-value store). A rank without one (a watcher on rank 0 only) would
#: leave gradwatch's all_reduce to pair with one of DDP's: the agreement is then turned off.
PEER_WAIT = 10.0
#: Store keys: a watcher's presence on a rank, how many ranks have it open, and the group's one verdict for
#: it ("together", or "solo:<ranks without it>"; removed when the last rank closes it). A watcher is named
#: by its model (class, parameter count) and how many watchers of that model are open in this process: the
#: same name on every rank of an SPMD script, another one for a probe watched on rank 0 only.
_LIVE_KEY = "gradwatch/live/{}/{}"
_OPEN_KEY = "gradwatch/open/{}"
#: Checks whose agreement collective carries a parameter fingerprint: the first (models built from other
#: seeds differ there) and the second (models built from one seed and trained on their own data or with
#: their own settings differ after one update; replicas never do).
FINGERPRINTS = 2
_VERDICT_KEY = "gradwatch/verdict/{}"
#: Store key: how many watchers (of any model) a global rank has open. A rank with none of this model's but
#: another one open watches another model: a pipeline stage, a model of its own.
_ANY_KEY = "gradwatch/any/{}"
_open_here: dict[str, list[str]] = {}


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process; ``(0, 1)`` when ``torch.distributed`` is not in use."""
    dist = _dist()
    if dist is None:
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def is_rank_zero() -> bool:
    """Whether this process writes reports: rank zero, or any process of a non-distributed run."""
    return rank_and_world()[0] == 0


def is_distributed() -> bool:
    """``torch.distributed`` is initialized with more than one process."""
    return rank_and_world()[1] > 1


def _dist() -> Any:
    if not torch.distributed.is_available():
        return None
    dist = torch.distributed
    if not dist.is_initialized():
        return None
    return dist


class RankAgreement:
    """Engine extension: one ``all_reduce`` per checked step so that every rank decides alike.

    Args:
        group: The process group to agree over (default: the whole world).

    Example:
        >>> # attached by gradwatch itself when torch.distributed is initialized with world_size > 1
        >>> RankAgreement().rank
        0
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.rank, self.world = 0, 1
        self._engine: Any = None
        self._slot = -1
        # This step's sharded parameters, in the optimizer's order (the same list on every rank, whatever
        # gradients this rank holds): (parameter, its index in ctx.params or -1 without a gradient here,
        # its module).
        self._sharded: list[tuple[torch.Tensor, int, str | None]] = []
        self._sharding_of: dict[int, float | None] = {}  # id(param) -> replication factor (None: unsupported)
        self._index_seen: Any = None
        self._any_sharded = False
        self._warned_sharding = False
        # Objects whose ``_join_config`` says whether a ``Join`` context (uneven inputs) covers them.
        self._joinables: list[Any] = []
        self._uneven = False  # a join context was seen: no collective of gradwatch's own from then on
        self._ddp_spotter: Any = None
        self._ddp_cls: Any = None
        self._spotted: Any = None  # the DDP wrapper whose forward ran the watched model (see _spot_ddp)
        self._ddp: Any = None  # the same, kept (find_unused_parameters)
        self._store: Any = None  # the process group's key-value store, where this watcher announced itself
        self._peers_checked = False
        self._solo = False  # some rank has no watcher: no collective of gradwatch's own
        self._replicas: bool | None = None  # the ranks' parameters agreed at the first checks (None: not asked)
        self._fingerprinted = False
        self._fingerprints = 0  # checks that carried a fingerprint (FINGERPRINTS at most)
        self._fsdp1: dict[int, float | None] = {}  # id(param) -> replication factor, for FSDP1's parameters
        self._key = ""  # this watcher's name in the store (see _announce)
        self._skip_guard: Any = None  # forward pre-hook: a step this rank's loop skipped (see skipped_step)
        self._synced = False  # DDP synchronizes the backward of the latest forward
        self._outer_guard: Any = None  # the same hook on the DDP wrapper, when the model inside it is watched
        self._loop_skipped: list[int] = []  # at this check: the ranks whose loop skipped it (their probes)
        self._unreduced_reported = False  # ddp_unused_parameters at a step: once per run
        self._checks_done = 0  # agreement collectives completed (equal on every rank): paces the replica check

    def attach(self, engine: Any) -> None:
        dist = _dist()
        if dist is not None:
            self.rank = dist.get_rank(self.group) if self.group is not None else dist.get_rank()
            self.world = dist.get_world_size(self.group) if self.group is not None else dist.get_world_size()
            self._announce(dist, engine.model, list(engine.optimizers))
        self._engine = engine
        engine.finding_tags["rank"] = self.rank
        model = engine.model
        self._find_joinables(engine)
        self._fsdp1 = _fsdp1_sharding(model)
        sharded = bool(self._fsdp1) or (model is not None and any(_is_dtensor(p) for p in model.parameters()))
        if engine.config.escalate and sharded:
            # Sharded modules all-gather their parameters inside forward: a localization replay that
            # only the ranks with an incident run would leave the others waiting in a collective (and
            # FSDP1 frees the gathered storage between uses: reading it there reads freed memory).
            engine.config = engine.config.replace(escalate=False)

    # -- uneven inputs: is a Join context in charge? ------------------------------------------------
    def _find_joinables(self, engine: Any) -> None:
        """The watched DDP module (also through ``torch.compile``'s wrapper) and optimizers (ZeRO) that a
        ``Join`` context can cover. When the watched model is the module *inside* a DDP wrapper, the wrapper
        is spotted during the forward (:meth:`_spot_ddp`)."""
        seen: set[int] = set()
        obj, depth = engine.model, 0
        while obj is not None and depth < 4 and id(obj) not in seen:
            seen.add(id(obj))
            if hasattr(obj, "_join_config"):
                self._joinables.append(obj)
            inner = getattr(obj, "_orig_mod", None)
            obj = inner if inner is not None else getattr(obj, "module", None)
            depth += 1
        for opt in engine.optimizers:
            if hasattr(opt, "_join_config"):
                self._joinables.append(opt)
        model = engine.model
        self._ddp_cls = _ddp_class()
        found = self._ddp_cls is not None and any(isinstance(j, self._ddp_cls) for j in self._joinables)
        if self._ddp_cls is not None and not found and isinstance(model, torch.nn.Module):
            self._ddp_spotter = owned(model, model.register_forward_pre_hook(self._spot_ddp))
        if self._ddp_cls is not None and self.world > 1 and isinstance(model, torch.nn.Module):
            self._skip_guard = owned(model, model.register_forward_pre_hook(self._before_forward))

    def _spot_ddp(self, module: Any, args: Any) -> None:
        # DDP's forward names itself in a class attribute while it runs the wrapped module. O(1), and kept
        # this small (no hook removal, no try) so that Dynamo traces it without a graph break when the
        # model is compiled; the hook stays until the run ends (removing it would cost a recompile).
        ddp = self._ddp_cls._active_ddp_module
        if ddp is not None:
            self._spotted = ddp
            self._ddp = ddp

    def _remove_spotter(self) -> None:
        if self._ddp_spotter is not None:
            self._ddp_spotter.remove()
            self._ddp_spotter = None
        for guard in (self._skip_guard, self._outer_guard):
            if guard is not None:
                guard.remove()
        self._skip_guard = self._outer_guard = None

    # -- a step this rank's loop skipped (see gradwatch.observe.skipped_step) ------------------------
    def _before_forward(self, module: Any, args: Any) -> None:
        if torch.compiler.is_compiling() or (self._outer_guard is not None and module is not self._ddp):
            return  # (the DDP wrapper's own hook runs first: before its forward's buffer broadcast)
        try:
            if self._outer_guard is None and self._ddp is not None and module is not self._ddp:
                # The model inside DDP is watched: DDP's forward broadcasts buffers before this hook runs, so
                # from now on the probe runs from a hook on the wrapper, ahead of every collective of its own.
                self._outer_guard = owned(self._ddp, self._ddp.register_forward_pre_hook(self._before_forward))
            if self._may_owe_check():
                self._probe()
            self._synced = ddp_synced(self._ddp_module())
        except GradWatchError:
            raise  # on_nonfinite="raise": every rank stops, this one too
        except Exception as exc:  # noqa: BLE001 - never break the user's forward
            internal_warning("RankAgreement (skipped step)", exc, owner=self._engine, key="RankAgreement.skipped")

    def before_close(self) -> None:
        """The loop ended right after a step it skipped on this rank: settle it, or the others wait for it.
        Not when it ended with an exception (``with`` exit): the others are not at a step then."""
        try:
            if sys.exc_info()[0] is None and self._may_owe_check():
                self._probe()
        except Exception as exc:  # noqa: BLE001 - GradWatchError too: the loop is over, close() goes on
            internal_warning("RankAgreement (skipped step)", exc, owner=self._engine, key="RankAgreement.skipped")

    def _may_owe_check(self) -> bool:
        """A synchronized backward ran since this rank's last optimizer step, and the loop goes on without a
        step: it accumulates (as every rank does), or it skipped the step here while the others wait in its
        check. Only the probe tells them apart."""
        engine = self._engine
        if not self._synced or engine is None or not backward_left_unstepped(engine):
            return False
        dist = _dist()
        if dist is None or self._any_sharded or under_fp16_autocast():
            return False
        return self._peers_watch(dist) and not self._in_join()

    def _probe(self) -> None:
        """The probe's all_reduce (one read); when other ranks were checking a step, the rest of that check."""
        dist, w = _dist(), self.world
        params = self._engine.index.per_optimizer[0].params
        device = self._device(None, [params[0]] if params else [])
        fingerprint = self._maybe_fingerprint(None, device)
        vec = torch.zeros(2 * w + (2 if fingerprint is not None else 0), dtype=torch.float32, device=device)
        if fingerprint is not None:
            vec[-2:] = torch.stack([fingerprint, fingerprint * fingerprint])
        mark_probe(vec, self.rank, w)
        dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=self.group)
        values = vec.tolist()
        if len(probing_ranks(values, w)) == w:
            return  # every rank probed: no step is waiting for this one
        try:
            self._settle(values, fingerprint is not None)
        finally:
            self._engine.step_done(0)  # counted as the other ranks count it

    def _settle(self, values: list[float], fingerprinted: bool) -> None:
        """The rest of the check the other ranks run on the step this rank's loop skipped: their collectives
        (what each rank saw, where the NaN was born), with nothing of this rank's own to add. Its flag makes
        every rank skip that update; no check of its own runs (no update of its own took these gradients)."""
        self._checks_done += 1
        if fingerprinted:
            self._fingerprints += 1
            self._replicas = self._same_everywhere(values[-2], values[-1], sum(self._engine.step_counts))
        engine = self._engine
        losses = list(engine.ledger.losses)  # observed since the last step: the skipped batch's (one read)
        bad_loss = bool(losses) and not all(bool(torch.isfinite(loss).all()) for loss in losses)
        engine.drop_losses()  # no update will take them: not held against the next step either
        mine = {"rank": self.rank, "nonfinite": [], "nonfinite_count": 0, "loss_nonfinite": bad_loss,
                "loss_observed": bool(losses), "inputs": []}
        self._gather(mine)  # the others' _exchange: every flagged check runs it (this rank is flagged)
        if not self._solo:
            self._gather(None)  # the others' _origins_of_others, on their incident

    def _in_join(self) -> bool:
        """A ``Join`` context (uneven inputs) covers the watched module or optimizer, now or earlier in the
        run. ``Join`` sets ``_join_config`` on its joinables when it is created (before any step of its
        block, on every rank) and never resets it; gradwatch stays local once it has seen it anyway."""
        spotted = self._spotted
        if spotted is not None:
            self._spotted = None
            if hasattr(spotted, "_join_config") and all(j is not spotted for j in self._joinables):
                self._joinables.append(spotted)
        if not self._uneven:
            for j in self._joinables:
                if getattr(getattr(j, "_join_config", None), "enable", False):
                    self._uneven = True
                    break
        return self._uneven

    # -- does every rank watch? ---------------------------------------------------------------------
    def _announce(self, dist: Any, model: Any, optimizers: list[Any]) -> None:
        """Announce this watcher in the store (its key, this global rank: +1 now, -1 at close)."""
        if isinstance(model, torch.nn.Module):
            name, count = type(model).__name__, sum(1 for _ in model.parameters())
        else:
            name, count = "optimizers", sum(len(g["params"]) for o in optimizers for g in o.param_groups)
        base = f"{name}:{count}"
        taken = _open_here.setdefault(base, [])
        self._key = next(k for k in (f"{base}#{i}" for i in range(len(taken) + 1)) if k not in taken)
        taken.append(self._key)
        try:
            from torch.distributed import distributed_c10d

            store = distributed_c10d._get_default_store()
            store.add(_LIVE_KEY.format(self._key, dist.get_rank()), 1)
            store.add(_OPEN_KEY.format(self._key), 1)
            store.add(_ANY_KEY.format(dist.get_rank()), 1)
            self._store = store
        except Exception:  # noqa: BLE001 - no store (a custom backend): keep the agreement on, as before
            self._store = None

    def _missing_peers(self, dist: Any) -> list[int]:
        """Ranks of the group with no live watcher, waiting up to PEER_WAIT seconds for late ones."""
        store = self._store
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else range(self.world)
        deadline = time.monotonic() + PEER_WAIT
        missing = list(ranks)
        while True:
            missing = [r for r in missing if store.add(_LIVE_KEY.format(self._key, r), 0) <= 0]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.05)

    def _peers_watch(self, dist: Any) -> bool:
        if self._peers_checked:
            return not self._solo
        self._peers_checked = True
        if self._store is None:
            return True
        try:
            # One verdict for the group, the first rank's to write it: a rank whose watcher starts after
            # another rank gave up waiting for it takes that rank's "solo" too (deciding "together" alone,
            # its all_reduce would pair with one of the user's).
            store, key = self._store, _VERDICT_KEY.format(self._key)
            if store.check([key]):
                verdict = store.get(key).decode()
            else:
                missing = self._missing_peers(dist)
                proposal = "solo:" + ",".join(map(str, missing)) if missing else "together"
                verdict = store.compare_set(key, "", proposal).decode()
        except Exception:  # noqa: BLE001
            return True
        if verdict.startswith("solo"):
            self._solo = True
            missing = [int(r) for r in verdict[5:].split(",") if r.strip().isdigit()]
            if self.rank in missing:
                what = (f"this rank's watcher of this model started more than {PEER_WAIT:g}s after the other "
                        "ranks checked their first step")
            else:
                ranks = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
                what = f"{ranks} had no open gradwatch watcher of this model when the first step was checked"
                if missing and all(self._watches_another(r) for r in missing):
                    # Every rank watches, each its own model: "watch on every rank" would be no advice.
                    safe_warn(
                        f"gradwatch: {what}, but {'they watch' if len(missing) > 1 else 'it watches'} another model "
                        "(a pipeline stage, a model of its own), so each rank decides alone on its own gradients (as "
                        "with rank_agreement=False). Nothing to change for pipeline stages or per-rank models; for "
                        "one model replicated on every rank (DDP), watch it on every rank, at the same point of the "
                        "script, to keep every rank's skip decision the same.",
                        stacklevel=3,
                    )
                    return False
                what += f" (none, one started more than {PEER_WAIT:g}s later, or one already closed)"
            safe_warn(
                f"gradwatch: {what}, so each rank decides alone (as with rank_agreement=False): gradwatch's "
                "per-step all_reduce would otherwise pair with one of DDP's or the user's on the other ranks. "
                "Watch on every rank, at the same point of the script (report on rank 0 only is automatic), to "
                "keep every rank's skip decision the same.",
                stacklevel=3,
            )
        return not self._solo

    def _watches_another(self, rank: int) -> bool:
        """Whether ``rank`` has a watcher of some model open (read from the store; never raises)."""
        try:
            return self._store is not None and self._store.add(_ANY_KEY.format(rank), 0) > 0
        except Exception:  # noqa: BLE001
            return False

    def close(self) -> None:
        self._remove_spotter()
        self._joinables = []
        store, self._store = self._store, None
        taken = _open_here.get(self._key.rpartition("#")[0], [])
        if self._key in taken:
            taken.remove(self._key)
        dist = _dist()
        if store is not None and dist is not None:
            try:
                store.add(_LIVE_KEY.format(self._key, dist.get_rank()), -1)
                store.add(_ANY_KEY.format(dist.get_rank()), -1)
                if store.add(_OPEN_KEY.format(self._key), -1) <= 0:
                    store.delete_key(_VERDICT_KEY.format(self._key))  # the next watcher of the name decides anew
            except Exception:  # noqa: BLE001 - the process group may be gone already
                pass

    def _ddp_module(self) -> Any:
        """The DDP module of the watched model (the model itself, or the wrapper seen running it), or None."""
        return self._ddp or next((j for j in self._joinables if self._ddp_cls and isinstance(j, self._ddp_cls)), None)

    def after_step(self, stats: StepStats, decision: str) -> None:
        if decision == "skip":
            ddp = self._ddp_module()
            if ddp is not None:
                _drop_comm_hook_memory(ddp)

    # -- before the sync: queue the flags and shard norms, run the collective ----------------------
    def before_sync(self, ctx: Any) -> None:
        self._slot = -1
        self._loop_skipped = []
        dist = _dist()
        if dist is None or self.world < 2:
            return
        self._mark_ddp(ctx.stats)
        if not self._peers_watch(dist):
            return  # a rank without a watcher: no collective (see _peers_watch)
        if self._in_join():
            # Uneven inputs: a rank that has run out of batches makes no more optimizer steps, and the join
            # context shadows only DDP's own collectives, so an all_reduce of gradwatch's would leave the
            # other ranks waiting (or pair with one of DDP's). No collective, every rank decides alone. DDP's
            # gradient all-reduce makes the gradients identical across ranks, so a decision on them agrees.
            # Given up for the rest of the run: agreement on what DDP does not reduce (a NaN/Inf only in one
            # rank's loss, a gradient outside DDP, hand-written reductions: that rank alone skips, and its
            # replica differs until the join context's final model sync), ``on_nonfinite="raise"`` on every
            # rank for those, rank zero naming another rank's parameters or data, and sharded norms.
            return
        batch = ctx.batch
        parts = [batch.part(slot) for slot, _ in ctx.norm_slots]
        loss_slot = ctx.slots.get("loss", -1)
        if loss_slot >= 0:
            parts.append(batch.part(loss_slot))
        device = self._device(ctx, parts)
        parts = [p.to(device, non_blocking=True) if p.device != device else p for p in parts]
        self._sharded = self._sharded_indices(ctx)
        if self._sharded:
            ctx.stats.extra["sharded"] = True  # element counts are of this rank's shards only
        # [world: this step's verdicts][world: a non-finite loss on an earlier batch no update used (one a
        # GradScaler dropped on every rank, or the training code skipped)][sharded squares]
        w = self.world
        fingerprint = self._maybe_fingerprint(ctx, device)
        extra = 2 if fingerprint is not None else 0
        vec = torch.zeros(2 * w + len(self._sharded) + extra, dtype=torch.float32, device=device)
        if fingerprint is not None:
            vec[-2:] = torch.stack([fingerprint, fingerprint * fingerprint])
        _flag_this_rank(vec, self.rank, w, ctx, parts, device)
        if self._sharded:
            vec[2 * w : 2 * w + len(self._sharded)] = self._local_squares(ctx, device)
        self._fingerprinted = fingerprint is not None
        dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=self.group)
        self._slot = batch.add(vec)

    def _mark_ddp(self, stats: StepStats) -> None:
        """Tell the checks that DDP runs the model, and whether it expects unused parameters."""
        ddp = self._ddp_module()
        if ddp is not None:
            stats.extra["ddp"] = True  # for the checks' wording (accumulation_remainder's fix)
        if ddp is not None and getattr(ddp, "find_unused_parameters", False):
            # The user told DDP that some parameters go unused on some steps: none_grad waits for them.
            stats.extra["unused_expected"] = True
        if ddp is not None and not self._unreduced_reported:
            facts = unreduced_facts(ddp, stats.step)  # no collective, no sync: DDP's reducer state
            if facts is not None:
                self._unreduced_reported = True
                self._engine.add_finding(unused_finding(facts))

    def _maybe_fingerprint(self, ctx: Any, device: torch.device) -> torch.Tensor | None:
        """On the first FINGERPRINTS checks, when no parameter is sharded: are the ranks replicas? A
        fingerprint of this rank's parameters (their first elements, summed), or None when not asked."""
        # Under DDP the ranks must stay replicas: asked again every REPLICA_CHECK_EVERY checks (a weight changed
        # on one rank mid-run). ``_checks_done`` and the DDP module are the same on every rank.
        periodic = self._checks_done % REPLICA_CHECK_EVERY == 0 and self._ddp_module() is not None
        first = self._fingerprints < FINGERPRINTS
        ask = self._replicas is not False and (first or periodic) and not self._any_sharded
        fingerprint = self._fingerprint(ctx, device) if ask else None
        if fingerprint is None and self._replicas is None:
            self._replicas = True  # sharded parameters (FSDP), or no fingerprint: not asked again
        return fingerprint

    def _fingerprint(self, ctx: Any, device: torch.device) -> torch.Tensor | None:
        try:
            params = [p for _, p in self._fingerprinted_params()]
            if not params:
                return None
            firsts = torch.stack([p.detach().reshape(-1)[0].to(device, torch.float32) for p in params[:512]])
            return firsts.abs().sum() + firsts.sum()
        except Exception as exc:  # noqa: BLE001 - no fingerprint: the ranks are taken for replicas
            internal_warning("RankAgreement (fingerprint)", exc, owner=self._engine, key="RankAgreement.fingerprint")
            return None

    def _fingerprinted_params(self) -> list[tuple[str, torch.Tensor]]:
        """(name, parameter) the fingerprint reads: under DDP the parameters DDP keeps in sync (not those it
        was told to ignore, nor an optimizer's parameters outside it), else every watched one."""
        ddp = self._ddp_module()
        if ddp is not None:
            kept = {id(p) for p in getattr(ddp, "_module_parameters", ddp.parameters())}
            return [(n, p) for n, p in ddp.module.named_parameters() if id(p) in kept and p.numel() > 0][:512]
        named = [(n, p) for op in self._engine.index.per_optimizer for n, p in zip(op.names, op.params)]
        return [(n, p) for n, p in named if p.numel() > 0][:512]

    def _same_everywhere(self, total: float, squares: float, step: int) -> bool:
        """From the summed fingerprints: do all ranks hold the same parameters (replicas)? If not, the
        processes train different models (a k-fold split or a sweep launched with torchrun): no agreement
        from here on, every rank decides alone. Every rank reads the same sums, so all switch together.
        Under DDP they are replicas by construction: different parameters are a bug (``replicas_diverged``),
        reported once, and the agreement stays (DDP pairs the ranks' steps)."""
        w = self.world
        mean = total / w
        spread = squares / w - mean * mean
        same = spread <= 1e-5 * max(mean * mean, 1e-12) + 1e-12
        if not same and self._ddp_module() is not None:
            self._report_diverged(step)
            return False
        if not same:
            self._solo = True
            safe_warn(
                "gradwatch: the processes of this torch.distributed run hold different parameters at a checked "
                "step, so they train different models, not replicas: each rank decides alone from now "
                "on (as with rank_agreement=False), and a NaN on one rank no longer skips the others' updates.",
                stacklevel=3,
            )
        return same

    def _report_diverged(self, step: int) -> None:
        """Every rank runs it on the same check: one all_gather of per-parameter signatures names them."""
        try:
            named = self._fingerprinted_params()
            device = named[0][1].device if named else torch.device("cpu")
            if "nccl" in str(_dist().get_backend(self.group)) and torch.cuda.is_available():
                device = torch.device("cuda", torch.cuda.current_device())
            gathered = gather_signatures(_dist(), self.group, self.world, [p for _, p in named], device)
            self._engine.add_finding(diverged_finding(diverged_facts(step, [n for n, _ in named], gathered)))
        except Exception as exc:  # noqa: BLE001 - never break training over a report
            internal_warning("RankAgreement (replicas)", exc, owner=self._engine, key="RankAgreement.replicas")

    def _device(self, ctx: Any, parts: list[torch.Tensor]) -> torch.device:
        dist = _dist()
        backend = str(dist.get_backend(self.group)) if dist is not None else "gloo"
        if "nccl" in backend and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if parts:
            return parts[0].device
        params = self._engine.index.per_optimizer[ctx.stats.optimizer_index].params
        return params[0].device if params else torch.device("cpu")

    def _sharded_indices(self, ctx: Any) -> list[int]:
        index = self._engine.index
        if index.per_optimizer is not self._index_seen:  # the parameter index was rebuilt
            self._index_seen = index.per_optimizer
            self._sharding_of = {}
            for op in index.per_optimizer:
                for p in op.params:
                    if id(p) in self._fsdp1:
                        self._sharding_of[id(p)] = self._fsdp1[id(p)]
                        continue
                    factor = _replication(p, self.world)
                    if factor != 1.0 or _is_dtensor(p):
                        self._sharding_of[id(p)] = factor
            self._any_sharded = bool(self._sharding_of)
        if not self._any_sharded:
            return []
        where = {id(p): i for i, p in enumerate(ctx.params)}
        out = []
        op = index.per_optimizer[ctx.stats.optimizer_index]
        for p, module in zip(op.params, op.modules):
            if id(p) not in self._sharding_of:
                continue
            if self._sharding_of[id(p)] is None:
                self._warn_sharding()
                continue
            out.append((p, where.get(id(p), -1), module))
        return out

    def _local_squares(self, ctx: Any, device: torch.device) -> torch.Tensor:
        # The local shard norms are already queued (``queue_grad_norms`` works on local shards): gather
        # them instead of computing them again.
        position: dict[int, int] = {}
        parts = []
        offset = 0
        for slot, idx in ctx.norm_slots:
            for pos, i in enumerate(idx):
                position[i] = offset + pos
            parts.append(ctx.batch.part(slot).to(device))
            offset += len(idx)
        norms = torch.cat(parts + [torch.zeros(1, device=device)])  # the last entry: a gradient with no norm
        take = torch.tensor([position.get(i, offset) for _p, i, _m in self._sharded], device=device)
        factors = torch.tensor(
            [self._sharding_of[id(p)] or 1.0 for p, _i, _m in self._sharded], dtype=torch.float32, device=device
        )
        return norms.index_select(0, take).square() / factors

    def _warn_sharding(self) -> None:
        if not self._warned_sharding:
            self._warned_sharding = True
            internal_warning(
                "RankAgreement (sharded norms)",
                NotImplementedError(
                    "a sharded parameter's device mesh does not span every process, or its gradient has a "
                    "Partial placement; its norm is reported for this rank's shard only"
                ),
            )

    # -- after the sync: read the agreement --------------------------------------------------------
    def after_sync(self, ctx: Any) -> None:
        if self._slot < 0:
            return
        values = ctx.batch.resolve()[self._slot]
        stats: StepStats = ctx.stats
        self._checks_done += 1
        if self._fingerprinted:
            self._fingerprinted = False
            self._fingerprints += 1
            self._replicas = self._same_everywhere(values[-2], values[-1], stats.step)
            values = values[:-2]
        self._loop_skipped = probing_ranks(values, self.world)
        if self._loop_skipped:
            values = without_probes(values, self.world)
        ranks, dropped = flagged_ranks(values, self.world)
        amp_slot = ctx.slots.get("amp_scaler_skips", -1)
        if dropped and amp_slot >= 0 and float(sum(ctx.batch.resolve()[amp_slot])) > 0:
            stats.extra["amp_dropped_here"] = True
        if dropped and self.rank not in dropped:
            # Another rank's loss was NaN/Inf on a batch no update used; its NaN gradients reached every rank
            # through the all-reduce (a GradScaler then dropped the step everywhere, which looks like an
            # ordinary overflow here). That rank reports its own loss; this one names it.
            self._engine.add_finding(other_rank_dropped_finding(stats, dropped))
        if self._sharded and len(stats.norms) == len(ctx.params):
            _apply_shard_norms(stats, self._sharded, values[2 * self.world :])
        if not ranks:
            return
        stats.extra["nonfinite_ranks"] = ranks
        if any(r != self.rank for r in ranks):
            stats.extra["any_rank_nonfinite"] = True
        stats.extra["rank_reports"] = self._exchange(stats)

    def _exchange(self, stats: StepStats) -> list[dict[str, Any]]:
        """What each rank saw, for rank zero's report. Every rank runs it on the same (incident) step."""
        dist = _dist()
        mine = {
            "rank": self.rank,
            "nonfinite": list(stats.nonfinite[:20]),
            "nonfinite_count": len(stats.nonfinite),
            "nan": sum(stats.nan_counts.values()),
            "inf": sum(stats.inf_counts.values()),
            "loss_nonfinite": stats.loss_nonfinite,
            "loss_observed": stats.loss is not None,
            "inputs": self._bad_inputs(stats),
        }
        if dist is None:
            return [mine]
        return [r for r in self._gather(mine) if isinstance(r, dict)]

    def _gather(self, mine: Any) -> list[Any]:
        """Every rank's ``mine`` (one all_gather_object; every rank of the agreement runs it at the same point)."""
        out: list[Any] = [None] * self.world
        _dist().all_gather_object(out, mine, group=self.group)
        return out

    def _bad_inputs(self, stats: StepStats) -> list[list[Any]]:
        """This rank's step inputs that hold NaN/Inf, ``[[name, nan, inf], ...]`` (incident path: one read).

        Never raises: every rank must reach the exchange's collective."""
        try:
            engine = self._engine
            if not stats.is_nonfinite or engine is None or engine.config.deferred:
                return []  # deferred: the statistics are a step old, the held inputs are the next step's
            from gradwatch.diagnose.escalation import Escalation

            esc = engine.extension(Escalation)
            if esc is None or not esc.active:
                return []  # escalate=False: no inputs are held
            return [[str(n), int(a), int(b)] for n, a, b in esc.nonfinite_inputs()[:8]]
        except Exception as exc:  # noqa: BLE001
            internal_warning("RankAgreement (inputs)", exc, owner=self._engine, key="RankAgreement.inputs")
            return []

    # -- incident: say which ranks ----------------------------------------------------------------
    def on_incident(self, stats: StepStats, findings: list[Finding]) -> list[Finding]:
        ranks = stats.extra.get("nonfinite_ranks")
        if not ranks:
            return []
        out = self._incident(stats, findings, ranks)
        return out + self._origins_of_others(stats, findings + out)

    def _origins_of_others(self, stats: StepStats, findings: list[Finding]) -> list[Finding]:
        """Where the NaN/Inf was born, as the rank that localized it says: each rank's ``nan_origin`` (if it
        named an op) is gathered (one ``all_gather_object``, on incident steps only: every rank of the
        agreement runs this on the same step), and a rank that named none reports the other's, so rank
        zero's console and JSON lines say where it was born."""
        dist = _dist()
        if dist is None or self.world < 2 or self._solo:
            return []
        mine, loss_only = own_origin(findings)
        summary = origin_summary(self.rank, mine, loss_only)
        try:
            out = self._gather(summary)
        except Exception as exc:  # noqa: BLE001
            internal_warning("RankAgreement (origins)", exc, owner=self._engine, key="RankAgreement.origins")
            return []
        if mine is not None:
            return []
        relayed = origin_to_relay(out, self.rank, loss_only_here=loss_only is not None)
        return [] if relayed is None else [relayed_finding(stats, relayed, self.rank)]

    def _incident(self, stats: StepStats, findings: list[Finding], ranks: list[int]) -> list[Finding]:
        reports = stats.extra.get("rank_reports") or []
        skipped = [r for r in self._loop_skipped if r != self.rank]
        said = [skipped_step_finding(stats, skipped)] if skipped else []
        seen = ranks_that_saw_values(ranks, skipped, reports)
        return (self._rank_incident(stats, findings, seen, reports) if seen else []) + said

    def _rank_incident(
        self, stats: StepStats, findings: list[Finding], ranks: list[int], reports: list[dict[str, Any]]
    ) -> list[Finding]:
        input_ranks = sorted(r.get("rank", 0) for r in reports if r.get("inputs"))
        for f in findings:
            if f.kind in NONFINITE_KINDS:
                f.data.setdefault("ranks", list(ranks))
            elif f.kind == "nonfinite_input" and input_ranks:
                f.data.setdefault("ranks", list(input_ranks))
        policy = self._engine.config.on_nonfinite
        if not stats.is_nonfinite:
            return [other_rank_finding(stats, ranks, reports, policy)]
        # This rank saw NaN/Inf too; when its own inputs and loss were finite, it most likely came from
        # another rank through the gradient all-reduce (DDP): name that rank, and its data when it was that.
        if self.rank in input_ranks:
            return []  # this rank's own nonfinite_input finding names the data (and the ranks)
        mine: dict[str, Any] = next((r for r in reports if r.get("rank") == self.rank), {})
        if input_ranks:
            return [other_rank_input_finding(stats, input_ranks, reports, policy)]
        loss_ranks = sorted(r.get("rank", 0) for r in reports if r.get("loss_nonfinite"))
        if loss_ranks and mine.get("loss_observed") and not mine.get("loss_nonfinite"):
            return [other_rank_finding(stats, loss_ranks, reports, policy, carried=True)]
        return []


def _flag_this_rank(vec: torch.Tensor, rank: int, world: int, ctx: Any, parts: list[torch.Tensor],
                    device: torch.device) -> None:
    """Write this rank's flags into the agreement vector (device ops, no sync): ``vec[rank]`` its step's
    gradients or loss are non-finite (an AMP overflow step aside), ``vec[world + rank]`` a non-finite loss of
    a batch no update uses."""
    batch, slots = ctx.batch, ctx.slots
    amp_slot = slots.get("amp_scaler_skips", -1)
    if parts:
        bad = (~torch.isfinite(torch.cat(parts))).any()
        if amp_slot >= 0:
            # The AMP scaler drops this update itself (an overflow step): not a reason to skip.
            bad = bad & (batch.part(amp_slot).to(device).sum() == 0)
        vec[rank] = bad.to(torch.float32)
    stale_slot = slots.get("stale_loss", -1)
    if stale_slot >= 0:
        vec[world + rank] = (~torch.isfinite(batch.part(stale_slot).to(device))).any().to(torch.float32)
    loss_slot = slots.get("loss", -1)
    if amp_slot >= 0 and loss_slot >= 0:
        # An optimizer that unscales in its own fused step runs step() on the steps a GradScaler drops:
        # this step's own non-finite loss is then one no update uses, as a stale one is.
        own = (~torch.isfinite(batch.part(loss_slot).to(device))).any() & (batch.part(amp_slot).to(device).sum() > 0)
        vec[world + rank] = torch.maximum(vec[world + rank], own.to(torch.float32))


def flagged_ranks(values: Any, world: int) -> tuple[list[int], list[int]]:
    """From the summed agreement vector: the ranks whose step was non-finite, and those whose non-finite
    loss was on a batch no update used."""
    return [r for r in range(world) if values[r] > 0], [r for r in range(world) if values[world + r] > 0]


def _apply_shard_norms(stats: StepStats, sharded: list[tuple[torch.Tensor, int, str | None]], squares: Any) -> None:
    """Replace the sharded parameters' norms by their norms over every shard (summed squares of all ranks)."""
    scale = float(stats.extra.get("grad_scale", 1.0) or 1.0)
    # Parameters whose shard on this rank is empty (FSDP1) have no gradient here but one elsewhere:
    # they count in the total and in their layer's norm all the same.
    elsewhere: dict[str, float] = {}
    for (_p, i, module), sq in zip(sharded, squares):
        norm = math.sqrt(sq) / scale if sq >= 0 else sq
        if i >= 0:
            stats.norms[i] = norm
        elif sq != 0:
            key = layer_key(module)
            elsewhere[key] = math.hypot(elsewhere.get(key, 0.0), norm)
    stats.total_norm = total_norm(stats.norms + list(elsewhere.values()))
    if stats.layer_norms:
        stats.layer_norms = layer_norms(stats.modules, stats.norms)
        for key, norm in elsewhere.items():
            stats.layer_norms[key] = math.hypot(stats.layer_norms.get(key, 0.0), norm)


#: Memories a DDP communication hook keeps from one step's gradients to the next: PowerSGD's error feedback
#: (the part of the gradient the low-rank approximation missed, added to the next step's) and its warm-start
#: P and Q matrices (``PowerSGDState``; also the batched hook's).
_HOOK_MEMORIES = ("error_dict", "p_memory_dict", "q_memory_dict")


def _drop_comm_hook_memory(ddp: Any) -> None:
    """After a skipped update: the hook made its memory from the step's non-finite gradients, and would add NaN
    to every later step's (each skipped, until ``too_many_skips``). Dropped, as before compression starts: the
    hook starts it again (zero error, new random Q from its own seeded generator). Every rank skips the same
    step, so the replicas' hooks stay alike."""
    for _hook, state in getattr(ddp, "_comm_hooks", None) or ():
        for name in _HOOK_MEMORIES:
            memory = getattr(state, name, None)
            if isinstance(memory, dict):
                memory.clear()


def _ddp_class() -> Any:
    import sys

    module = sys.modules.get("torch.nn.parallel.distributed")
    return getattr(module, "DistributedDataParallel", None) if module is not None else None


def _is_dtensor(t: Any) -> bool:
    import sys

    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None) if module is not None else None
    return cls is not None and isinstance(t, cls)


def _fsdp1_sharding(model: Any) -> dict[int, float | None]:
    """FSDP1 (``FullyShardedDataParallel``): id of each parameter it shards -> how many ranks hold each
    element (1.0 when fully sharded; None under hybrid sharding, whose norms stay this rank's). Its
    parameters are plain tensors holding this rank's shard (``use_orig_params=True``: a view of it, empty
    on ranks that hold none of the parameter). Empty when the model has no FSDP1 module."""
    import sys

    module = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    cls = getattr(module, "FullyShardedDataParallel", None) if module is not None else None
    if cls is None or not isinstance(model, torch.nn.Module):
        return {}
    out: dict[int, float | None] = {}
    for m in model.modules():  # outer modules first: an inner FSDP module's strategy wins for its parameters
        if not isinstance(m, cls):
            continue
        name = getattr(getattr(m, "sharding_strategy", None), "name", "")
        factor = None if "HYBRID" in name else 1.0
        for p in m.parameters():
            if name == "NO_SHARD":
                out.pop(id(p), None)  # full replicas, as under DDP
            else:
                out[id(p)] = factor
    return out


def _replication(p: Any, world: int) -> float | None:
    """How many ranks hold each shard of ``p`` (1.0 for a plain tensor); None when not supported."""
    if not _is_dtensor(p):
        return 1.0
    mesh = p.device_mesh
    if mesh.size() != world:
        return None
    factor = 1
    for dim, placement in enumerate(p.placements):
        if placement.is_shard():
            continue
        if placement.is_replicate():
            factor *= mesh.size(dim)
            continue
        return None  # Partial: the local values are summands, their norm is not a shard norm
    return float(factor)
