"""The TensorBoard scalars of a checked step, and the bounded sample of norms behind the run summary."""

from __future__ import annotations

from collections.abc import Mapping

from gradwatch.core.stats import StepStats

#: Norms kept for the summary's median before every other one is dropped.
SAMPLE_SIZE = 4096


class StepScalars:
    """This run's scalars per checked step. Per-layer norms every ``layer_every`` checked steps of each
    optimizer (and at a step with findings), counters when they change: fewer events, same charts.

    Args:
        layer_every: Per-layer norms every this many checked steps.
        several_optimizers: Tags carry the optimizer (``_opt1``): a GAN's two losses are two series.
    """

    def __init__(self, layer_every: int, several_optimizers: bool) -> None:
        self.layer_every = layer_every
        self.several_optimizers = several_optimizers
        self._layer_names: tuple[str, ...] = ()
        self._layer_tag_list: list[str] = []
        self._last_counters: dict[str, float] = {}
        self._scalar_steps: dict[int, int] = {}
        self._tags: dict[int, tuple[str, str]] = {}  # per optimizer: (total norm tag, loss tag)
        # What the counters were made of at the previous step: when it is the same, every counter equals the
        # value written last (each step leaves ``_last_counters`` holding all of its counters) and none is due.
        self._counted: tuple[int, int, dict[str, int]] | None = None

    def of(
        self, stats: StepStats, steps_skipped: int, kind_counts: Mapping[str, int], *, every_value: bool = False
    ) -> dict[str, float]:
        """The scalars of ``stats``; ``every_value`` (a step with findings) writes every one."""
        i = stats.optimizer_index
        tags = self._tags.get(i) or self._new_tags(i)
        out: dict[str, float] = {}
        if stats.names:
            out[tags[0]] = stats.total_norm
        seen = self._scalar_steps[i] = self._scalar_steps.get(i, 0) + 1
        full = every_value or (seen - 1) % self.layer_every == 0  # each optimizer its own cadence
        if full:
            self._layers(stats, out)
        if stats.loss is not None:
            out[tags[1]] = stats.loss  # a GAN's two losses: two series
        self._counters(out, full, steps_skipped, len(stats.nonfinite), kind_counts)
        more = stats.extra.get("scalars")
        if isinstance(more, dict):
            out.update(more)
        return out

    def _new_tags(self, i: int) -> tuple[str, str]:
        """Optimizer ``i``'s total-norm and loss tags (``_opt{i}`` with several optimizers: a GAN's two series)."""
        suffix = f"_opt{i}" if self.several_optimizers else ""
        tags = self._tags[i] = (f"gradwatch/grad_norm/total{suffix}", f"gradwatch/loss{suffix}")
        return tags

    def _counters(
        self, out: dict[str, float], full: bool, skipped: int, nonfinite: int, kind_counts: Mapping[str, int]
    ) -> None:
        """The counters due: all of them at a full step, else those that changed since they were written."""
        counted = self._counted
        unchanged = (  # (``items()`` compared: a C comparison, where a Counter's ``==`` is a Python call)
            counted is not None
            and counted[0] == skipped
            and counted[1] == nonfinite
            and counted[2].items() == kind_counts.items()
        )
        if unchanged and not full:
            return  # the usual step: nothing new counted, so each counter equals the value written last
        self._counted = (skipped, nonfinite, dict(kind_counts))
        counters = {"gradwatch/skipped_steps": float(skipped), "gradwatch/nonfinite_grads": float(nonfinite)}
        for kind, n in kind_counts.items():
            counters["gradwatch/findings/" + kind] = float(n)
        last = self._last_counters
        for tag, v in counters.items():
            if full or last.get(tag) != v:
                out[tag] = last[tag] = v

    def _layers(self, stats: StepStats, out: dict[str, float]) -> None:
        norms = stats.layer_norms
        layers = tuple(norms)
        if layers != self._layer_names:  # the same layers, in the same order, at almost every step
            self._layer_names = layers
            self._layer_tag_list = [f"gradwatch/grad_norm/{layer}" for layer in layers]
        out.update(zip(self._layer_tag_list, norms.values()))


class NormSample:
    """A bounded sample of the run's total gradient norms: every k-th value, k doubling when full."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self._stride = 1
        self._seen = 0

    def add(self, v: float) -> None:
        self._seen += 1
        if (self._seen - 1) % self._stride == 0:
            self.values.append(v)
            if len(self.values) >= SAMPLE_SIZE:
                self.values = self.values[::2]
                self._stride *= 2
