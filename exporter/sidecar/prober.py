"""The sampled-quality prober: a fixed prompt x seed set, compared with the baseline.

Quality loss is invisible on every performance panel (PSNR 36 -> 31 dB with
step times normal), so this is the only signal for it.  One ``run_once()``
sends the probe set through the service's public API, scores each output
against the baseline of the service's deployment fingerprint, and exports
p50 / p10 / min PSNR and SSIM per service instance.  The cadence keeps the
probes within ``quality.probe_budget_ratio`` of the service's GPU time.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from prometheus_client import CollectorRegistry

from stepwatch.catalog import METRICS
from stepwatch.exporter.sidecar.baseline import Baseline, BaselineStore, Lookup
from stepwatch.exporter.sidecar.client import REASONS, Generated, ProbeError, ServiceClient, ServiceInfo
from stepwatch.exporter.sidecar.config import VIDEO_GATE, ProbeSet, check_gate, default_probe_set, gate_db
from stepwatch.exporter.sidecar.quality import QUANTILES, Score, ShapeMismatch, score, score_frames, summarize
from stepwatch.metrics import SidecarMetrics
from stepwatch.thresholds import Thresholds, load

log = logging.getLogger("stepwatch.sidecar.prober")

QUALITY_METRICS: tuple[str, ...] = tuple(m.name for m in METRICS
                                         if m.owner == "sidecar" and m.name.startswith("stepwatch_quality_"))
# Failing fast: a refused connection or a 503 (the service says it cannot serve now: warming up, shutting
# down, its worker restarting) ends the set, since the rest would only add load to a service that is
# recovering; so do this many timeouts in a row.
ENDS_THE_SET = ("connect", "http_503")
MAX_CONSECUTIVE_TIMEOUTS = 3
# How long a target may stay not ready (refusing connections, answering 503 or "warming up") before the prober
# counts it as failing: a restart's warm-up, compiles included, is well within it; a service that never comes
# back is counted after it (reason ``not_ready``, or ``connect`` when nothing listens).
NOT_READY_GRACE_S = 600.0

Status = Literal["ok", "partial", "stale", "baseline_error", "failed", "aborted", "not_ready"]


def quality_metrics(registry: CollectorRegistry) -> SidecarMetrics:
    """The prober's collectors from the catalog, registered on ``registry``.

    ``SidecarMetrics`` builds every sidecar collector; the NVML ones are served by a
    scrape-time collector instead, so only the quality ones go on ``registry``.
    """
    ms = SidecarMetrics(CollectorRegistry())
    for name in QUALITY_METRICS:
        registry.register(getattr(ms, name.removeprefix("stepwatch_")))
    return ms


@dataclass
class ImageOutcome:
    """One probe of the set: its score, or why it failed."""

    item_id: str
    instance_id: str | None = None
    fingerprint_id: str | None = None
    psnr: float | None = None
    ssim: float | None = None
    frames: int = 1
    worst_frame: int | None = None
    worst_ssim_frame: int | None = None
    frame_psnr: tuple[float, ...] = ()  # a video probe's every frame (the set's stats are over frames)
    frame_ssim: tuple[float, ...] = ()
    service_seconds: float | None = None
    wall_seconds: float | None = None
    failure: str | None = None
    detail: str | None = None
    stale: bool = False


@dataclass
class ProbeResult:
    """What one run of the probe set found (``Prober.run_once()``)."""

    probe_set: str
    status: Status
    started_unix: float
    duration_s: float = 0.0
    gate_kind: str = ""
    gate_db: float = math.nan
    alert_below_db: float = math.nan
    ssim_gate: float | None = None
    target_fingerprint_id: str | None = None
    baseline_fingerprint_id: str | None = None
    images: list[ImageOutcome] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    per_instance: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    error: str | None = None
    cost_seconds: float | None = None
    cost_gpu_seconds: float | None = None

    @property
    def completed(self) -> bool:
        """Counted in ``stepwatch_quality_probe_runs_total`` (stale runs complete without a PSNR)."""
        return self.status in ("ok", "partial", "stale")

    @property
    def stale(self) -> bool:
        return self.status == "stale" or any(i.stale for i in self.images)

    @property
    def scored(self) -> list[ImageOutcome]:
        return [i for i in self.images if i.psnr is not None]

    @property
    def psnr(self) -> dict[str, float]:
        """{p50, p10, min} over every scored probe, or every frame of a video set ({} when none)."""
        vals = per_frame(self.scored, "psnr")
        return summarize(vals) if vals else {}

    @property
    def ssim(self) -> dict[str, float]:
        vals = per_frame(self.scored, "ssim")
        return summarize(vals) if vals else {}

    @property
    def below_alert(self) -> bool:
        """p10 PSNR below gate - margin: what the QualityDrop alert fires on."""
        p = self.psnr
        return bool(p) and p["p10"] < self.alert_below_db


def per_frame(outcomes: list[ImageOutcome], metric: Literal["psnr", "ssim"]) -> list[float]:
    """The values a set's stats are taken over: each image's, and each frame of a video (so p50 and p10 are
    over frames and ``min`` is the worst frame, the one the video gates judge)."""
    out: list[float] = []
    for o in outcomes:
        frames = o.frame_psnr if metric == "psnr" else o.frame_ssim
        whole = o.psnr if metric == "psnr" else o.ssim
        if frames:
            out += frames
        elif whole is not None:
            out.append(whole)
    return out


@dataclass(frozen=True)
class Cadence:
    interval_s: float | None
    source: Literal["override", "budget", "unknown"]
    text: str


class Prober:
    """Runs the probe set against one target and exports the results on ``registry``.

    ``run_once()`` is one probe run (what tests and drills call); ``run_forever(stop)``
    repeats it on the budget cadence until ``stop`` is set.
    """

    def __init__(self, target: str, *, registry: CollectorRegistry, baseline_dir: str | Path,
                 probe_set: ProbeSet | None = None, thresholds: Thresholds | None = None,
                 gate: str | None = None, interval_s: float | None = None, timeout_s: float | None = None,
                 timeout_margin_s: float = 5.0, initial_timeout_s: float = 60.0, info_timeout_s: float = 5.0,
                 budget_ratio: float | None = None, min_interval_s: float = 5.0, retry_interval_s: float = 30.0,
                 not_ready_grace_s: float = NOT_READY_GRACE_S, wallclock: Callable[[], float] = time.time,
                 metrics: SidecarMetrics | None = None) -> None:
        if thresholds is None:
            thresholds = load()
        q = thresholds.quality
        self.probe_set = probe_set or default_probe_set()
        self.gate_kind = self.probe_set.gate_kind(gate) or q.default_gate
        check_gate(q, self.gate_kind, "gate")
        self.gate_db = gate_db(q, self.gate_kind)
        self.alert_below_db = self.gate_db - q.alert_margin_db
        self.ssim_gate = q.ssim_gate.get("video" if self.gate_kind == VIDEO_GATE or self.probe_set.is_video
                                         else "image")
        # The SSIM alert judges the worst frame of the sets whose gate is an SSIM gate too: video sets (the seeds'
        # 0.92) and high-quality image sets (0.95); other image sets are gated on PSNR (0: no SSIM gate).
        ssim_gated = self.gate_kind in (VIDEO_GATE, "high_quality") or self.probe_set.is_video
        self.ssim_gate_alerted = (self.ssim_gate or 0.0) if ssim_gated else 0.0
        self.budget_ratio = budget_ratio if budget_ratio is not None else q.probe_budget_ratio
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.timeout_margin_s = timeout_margin_s
        self.initial_timeout_s = initial_timeout_s
        self.info_timeout_s = info_timeout_s
        self.min_interval_s = min_interval_s
        self.retry_interval_s = retry_interval_s
        self.not_ready_grace_s = not_ready_grace_s
        self._unready_since: float | None = None  # wall time the target was first seen not ready, in this spell
        self.store = BaselineStore(baseline_dir)
        self.client = ServiceClient(target)
        self.target = self.client.target
        self._wallclock = wallclock
        self.metrics = metrics or quality_metrics(registry)  # a second prober shares the first one's
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reported: set[str] = set()
        self._last_state: tuple[str, str] | None = None
        self.cost_seconds: float | None = None
        self.gpus = 1
        self.expected_request_s: float | None = None
        self.last_result: ProbeResult | None = None
        self._lookup: Lookup | None = None
        name = self.probe_set.name
        m = self.metrics
        m.quality_gate_decibels.labels(name).set(self.gate_db)
        m.quality_ssim_gate_ratio.labels(name).set(self.ssim_gate_alerted)
        m.quality_baseline_stale.labels(name).set(0)
        m.quality_baseline_ok.labels(name).set(0)
        m.quality_probe_runs_total.labels(name)
        # 0 = never succeeded.  The probe-failing alert skips 0 (``last_success > 0``) and catches a prober
        # that never succeeds by its failure counter instead, so every failed run counts a failure.
        m.quality_last_success_timestamp_seconds.labels(name).set(0)
        m.quality_target_not_ready_timestamp_seconds.labels(name).set(0)
        for reason in ("connect", "timeout", "bad_response", "baseline", "not_ready"):
            m.quality_probe_failures_total.labels(name, reason)

    # --- timing --------------------------------------------------------------------------

    def request_timeout(self) -> float:
        """Explicit, or a few seconds beyond the slowest probe request seen (initial value before that).

        After a run with timeouts it doubles (up to the initial value): the service got slower.
        """
        if self.timeout_s is not None:
            return self.timeout_s
        if self.expected_request_s is not None:
            return self.expected_request_s + self.timeout_margin_s
        return self.initial_timeout_s

    def cadence(self) -> Cadence:
        """The interval between runs, and the sentence that explains it."""
        n = len(self.probe_set.items)
        cost = None
        if self.cost_seconds is not None:
            cost = (f"probe set {self.probe_set.name!r} costs {self.cost_seconds * self.gpus:.1f} GPU-s "
                    f"({n} probes, {self.cost_seconds:.1f} s x {self.gpus} GPU)")
        pct = f"{self.budget_ratio * 100:g}%"
        if self.interval_s is not None:
            text = f"probe cadence fixed at every {self.interval_s:g} s (set explicitly)"
            if cost is not None and self.cost_seconds is not None:
                used = self.cost_seconds / self.interval_s
                text = f"{cost}; {text}, {used * 100:.2g}% of the instance's GPU time"
                if used > self.budget_ratio:
                    text += f", above the {pct} budget"
            return Cadence(self.interval_s, "override", text)
        if self.cost_seconds is None:
            return Cadence(None, "unknown", "probe set cost not measured yet; the cadence follows from the first run")
        # The set's GPU-seconds over the GPU-seconds the instance has per second (its GPUs) must stay <= ratio.
        gpu_s = self.cost_seconds * self.gpus
        interval = max(self.min_interval_s, gpu_s / (self.budget_ratio * self.gpus))
        return Cadence(interval, "budget", f"{cost}; at {pct} budget the cadence is every {interval:.0f} s")

    # --- one run -------------------------------------------------------------------------

    def run_once(self) -> ProbeResult:
        """Probe the set once, export the result, and return it.  Never raises."""
        with self._lock:
            t0 = time.monotonic()
            res = ProbeResult(self.probe_set.name, "failed", self._wallclock(), gate_kind=self.gate_kind,
                              gate_db=self.gate_db, alert_below_db=self.alert_below_db, ssim_gate=self.ssim_gate)
            self._lookup = None
            try:
                self._run(res)
            except Exception as e:  # a bug here must not stop the sidecar
                log.exception("probe run failed unexpectedly")
                res.status, res.error = "failed", f"{type(e).__name__}: {e}"
                self._fail(res, "bad_response")  # counted, so the probe-failing alert sees the run fail
            res.duration_s = time.monotonic() - t0
            self._export(res)
            self._log_state(res)
            self.last_result = res
            return res

    def _fail(self, res: ProbeResult, reason: str) -> None:
        res.failures[reason] = res.failures.get(reason, 0) + 1

    def _run(self, res: ProbeResult) -> None:
        try:
            # A metadata read, not a generation: it keeps its own timeout, so a probe timeout set tight
            # for a fast (few-step) model cannot fail the set on a loaded host before any probe ran.
            info = self.client.info(self.info_timeout_s)
        except ProbeError as e:
            if e.reason in ENDS_THE_SET:
                self._not_ready(res, e.reason, e.detail)
            else:
                self._fail(res, e.reason)
                res.error = f"target {self.target}: {e.detail}"
            return
        if info.ready is False or not info.fingerprint:
            # A restart's warm-up answers an empty fingerprint: hashed, it would read as a new deployment with no
            # baseline. Nothing is measured or concluded until the service is ready.
            self._not_ready(res, "not_ready", "warming up")
            return
        self._unready_since = None
        res.target_fingerprint_id = info.fingerprint_id
        self.gpus = info.gpus
        lk = self.store.lookup(self.probe_set, info.fingerprint_id)
        self._lookup = lk
        if lk.state in ("missing", "error"):
            self._fail(res, "baseline")
            res.status, res.error = "baseline_error", str(lk.error)
            return
        if lk.state == "stale":
            res.status = "stale"
            res.baseline_fingerprint_id = lk.baseline.fingerprint_id if lk.baseline else None
            res.error = (f"deployment fingerprint {info.fingerprint_id} has no baseline "
                         f"(stored: {', '.join(lk.stored)}); no PSNR until `stepwatch baseline capture` is rerun")
            return
        assert lk.baseline is not None
        base = lk.baseline
        res.baseline_fingerprint_id = base.fingerprint_id
        if self.cost_seconds is None and base.cost_seconds is not None:
            self.cost_seconds = base.cost_seconds
        self._probe_all(res, info, base)

    def _unready_spell(self) -> float:
        """Seconds since the target was first seen not ready in this spell (0 on the first sighting)."""
        now = self._wallclock()
        if self._unready_since is None:
            self._unready_since = now
        return now - self._unready_since

    def _not_ready(self, res: ProbeResult, reason: str, why: str) -> None:
        """The target is restarting or warming up: within the grace nothing is measured, failed or made stale
        (status ``not_ready``); past it, the run fails with ``reason`` and the probe-failing alert may fire."""
        spell = self._unready_spell()
        if spell < self.not_ready_grace_s:
            res.status = "not_ready"
            res.error = (f"target {self.target} is not ready ({why}): no probe, no failure and no staleness "
                         f"for up to {self.not_ready_grace_s:g} s")
            return
        self._fail(res, reason)
        res.error = (f"target {self.target} not ready for {spell:.0f} s, past the {self.not_ready_grace_s:g} s "
                     f"grace: {why}")

    def _cut_by_a_restart(self, res: ProbeResult, reason: str) -> bool:
        """A set cut off by a refused connection or a 503: when the target now says it is not ready (a restart,
        its worker restarting) within the grace, the run is ``not_ready`` and the cut probe is no failure."""
        try:
            info = self.client.info(self.info_timeout_s)
        except ProbeError as e:
            if e.reason not in ENDS_THE_SET:
                return False
        else:
            if info.ready is not False and info.fingerprint:
                return False
        if self._unready_spell() >= self.not_ready_grace_s:
            return False
        res.failures[reason] -= 1
        if not res.failures[reason]:
            del res.failures[reason]
        self._not_ready(res, reason, "it went away during the set")
        return True

    def _probe_all(self, res: ProbeResult, info: ServiceInfo, base: Baseline) -> None:
        timeouts = 0
        timeout = self.request_timeout()
        for item in self.probe_set.items:
            if self._stop.is_set():
                res.status = "aborted"
                return
            out = ImageOutcome(item.id, frames=item.expected_frames)
            res.images.append(out)
            try:
                gen = self.client.generate(item, timeout)
            except ProbeError as e:
                out.failure, out.detail = e.reason, e.detail
                self._fail(res, e.reason)
                timeouts = timeouts + 1 if e.reason == "timeout" else 0
                if e.reason in ENDS_THE_SET and self._cut_by_a_restart(res, e.reason):
                    return
                if e.reason in ENDS_THE_SET or timeouts >= MAX_CONSECUTIVE_TIMEOUTS:
                    res.error = f"target {self.target}: {e.detail} (rest of the set skipped)"
                    break
                continue
            timeouts = 0
            self._score(res, out, gen, info, base)
        self._finish(res, info)
        if res.failures.get("timeout") and self.timeout_s is None:
            self._grow_timeout(timeout)

    def _grow_timeout(self, used: float) -> None:
        """Requests timed out at ``used`` seconds: allow twice that next run, capped at the initial timeout.

        Without this the timeout could only shrink (it follows the slowest *answered* request),
        so a service that slowed down would time out on every run from then on.
        """
        grown = max(used, min(2 * used, self.initial_timeout_s))
        self.expected_request_s = grown - self.timeout_margin_s
    def _score(self, res: ProbeResult, out: ImageOutcome, gen: Generated, info: ServiceInfo, base: Baseline) -> None:
        out.instance_id = gen.instance_id or info.instance_id
        out.fingerprint_id = gen.fingerprint_id or info.fingerprint_id
        out.service_seconds, out.wall_seconds = gen.service_seconds, gen.wall_seconds
        if out.fingerprint_id != base.fingerprint_id:
            out.stale = True  # another deployment answered (behind a balancer): not comparable
            return
        ref = base.frames[out.item_id]
        try:
            s: Score = score_frames(gen.frames, ref) if len(ref) > 1 or out.frames > 1 else score(gen.frames[0], ref[0])
        except ShapeMismatch as e:
            out.failure, out.detail = "bad_response", f"probe {out.item_id}: {e}"
            self._fail(res, "bad_response")
            return
        out.psnr, out.ssim, out.frames, out.worst_frame = s.psnr, s.ssim, s.frames, s.worst_psnr_frame
        out.worst_ssim_frame, out.frame_psnr, out.frame_ssim = s.worst_ssim_frame, s.frame_psnr, s.frame_ssim

    def _finish(self, res: ProbeResult, info: ServiceInfo) -> None:
        scored = res.scored
        answered = [i for i in res.images if i.failure is None]
        if not scored:
            res.status = "stale" if any(i.stale for i in res.images) else "failed"
            if res.status == "stale":
                res.error = "every probe was answered by another deployment fingerprint than the baseline's"
            return
        res.status = "ok" if len(scored) == len(self.probe_set.items) else "partial"
        by_inst: dict[str, list[ImageOutcome]] = {}
        for i in scored:
            by_inst.setdefault(i.instance_id or info.instance_id, []).append(i)
        for inst, outs in by_inst.items():
            res.per_instance[inst] = {"psnr": summarize(per_frame(outs, "psnr")),
                                      "ssim": summarize(per_frame(outs, "ssim"))}
        per_image = [o.service_seconds if o.service_seconds is not None else (o.wall_seconds or 0.0)
                     for o in answered]
        self.cost_seconds = sum(per_image) / len(per_image) * len(self.probe_set.items)
        self.expected_request_s = max(o.wall_seconds or 0.0 for o in answered)
        res.cost_seconds = self.cost_seconds
        res.cost_gpu_seconds = self.cost_seconds * info.gpus

    # --- export --------------------------------------------------------------------------

    def _clear_quality(self, keep: set[str] | None = None) -> None:
        """Drop PSNR/SSIM series not measured now: a stale or broken baseline must not leave old values."""
        keep = keep or set()
        m, name = self.metrics, self.probe_set.name
        for inst in self._reported - keep:
            for q, _ in QUANTILES:
                m.quality_psnr_decibels.remove(name, inst, q)
                m.quality_ssim_ratio.remove(name, inst, q)
        self._reported &= keep

    def _export(self, res: ProbeResult) -> None:
        m, name = self.metrics, self.probe_set.name
        for reason, n in res.failures.items():
            m.quality_probe_failures_total.labels(name, reason if reason in REASONS else "http_other").inc(n)
        if res.status == "not_ready":  # the staleness clock of the probe-failing alert waits while it warms up
            m.quality_target_not_ready_timestamp_seconds.labels(name).set(res.started_unix + res.duration_s)
        if res.status in ("failed", "aborted", "not_ready"):
            return  # nothing new was measured: the last values stay, their age shows in last_success
        lk = self._lookup
        if res.status == "baseline_error":
            m.quality_baseline_ok.labels(name).set(0)
            m.quality_baseline_stale.labels(name).set(0)
            self._clear_quality()
            return
        m.quality_baseline_ok.labels(name).set(1 if lk is not None and lk.error is None else 0)
        m.quality_baseline_stale.labels(name).set(1 if res.stale else 0)
        m.quality_probe_runs_total.labels(name).inc()
        m.quality_last_success_timestamp_seconds.labels(name).set(res.started_unix + res.duration_s)
        if res.status == "stale":
            self._clear_quality()
            return
        m.quality_probe_duration_seconds.labels(name).observe(res.duration_s)
        self._export_scores(res)

    def _export_scores(self, res: ProbeResult) -> None:
        """The set's PSNR and SSIM quantiles per instance (what the quality alerts read)."""
        m, name = self.metrics, self.probe_set.name
        for inst, summary in res.per_instance.items():
            for q, _ in QUANTILES:
                m.quality_psnr_decibels.labels(name, inst, q).set(summary["psnr"][q])
                m.quality_ssim_ratio.labels(name, inst, q).set(summary["ssim"][q])
        self._reported |= set(res.per_instance)
        self._clear_quality(set(res.per_instance))

    def _log_state(self, res: ProbeResult) -> None:
        """One line per change of state, not one per run (a target down for an hour logs once)."""
        key = (res.status, res.error or "")
        if res.status == "aborted":
            return
        if res.status in ("ok", "partial"):
            p = res.psnr
            worst = min(res.scored, key=lambda i: i.psnr if i.psnr is not None else math.inf)
            line = (f"probe set {res.probe_set!r}: {len(res.scored)}/{len(self.probe_set.items)} scored, "
                    f"PSNR p50 {p['p50']:.2f} p10 {p['p10']:.2f} min {p['min']:.2f} dB "
                    f"(gate {self.gate_db:g}, alert below {self.alert_below_db:g}); worst probe {worst.item_id}"
                    + (f" frame {worst.worst_frame} of {worst.frames}" if worst.frames > 1 else ""))
            state = ("measuring", "")
            if res.below_alert:
                log.warning("%s: BELOW the quality gate", line)
            elif self._last_state != state:
                log.info("%s", line)
            else:
                log.debug("%s", line)
            if res.failures:
                log.warning("probe set %r: %d probe requests failed: %s", res.probe_set,
                            sum(res.failures.values()), res.failures)
            self._last_state = state
            return
        if key != self._last_state:
            log.warning("probe set %r: %s: %s", res.probe_set, res.status, res.error)
        else:
            log.debug("probe set %r: %s: %s", res.probe_set, res.status, res.error)
        self._last_state = key

    # --- the loop ------------------------------------------------------------------------

    def run_forever(self, stop: threading.Event | None = None) -> None:
        """Probe on the cadence until ``stop`` is set (or ``close()`` is called)."""
        if stop is not None:
            self._stop = stop
        announced: Cadence | None = None
        while not self._stop.is_set():
            res = self.run_once()
            cad = self.cadence()
            if announced is None or cad.source != announced.source or _changed(cad.interval_s, announced.interval_s):
                log.info("%s", cad.text)
                announced = cad
            delay = cad.interval_s if cad.interval_s is not None else self.retry_interval_s
            # The cadence in force, so "no success for 3 intervals" can be judged by the rules.
            self.metrics.quality_probe_interval_seconds.labels(self.probe_set.name).set(delay)
            if res.status == "not_ready":  # back to measuring soon after it is ready: an info call is cheap
                delay = min(delay, self.min_interval_s)
            elif not res.completed:
                delay = min(delay, self.retry_interval_s)
            self._stop.wait(delay)

    def close(self, timeout: float = -1) -> None:
        """Stop the loop; the HTTP client closes once no run is in flight (or is left to the GC)."""
        self._stop.set()
        if self._lock.acquire(timeout=timeout):
            try:
                self.client.close()
            finally:
                self._lock.release()


def _changed(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a != b
    return abs(a - b) > 0.25 * max(a, b)


def describe(res: ProbeResult) -> dict[str, Any]:
    """A JSON-able summary of a run (for logs, the CLI and drills)."""
    return {
        "probe_set": res.probe_set, "status": res.status, "duration_s": round(res.duration_s, 3),
        "gate_db": res.gate_db, "alert_below_db": res.alert_below_db, "psnr": res.psnr, "ssim": res.ssim,
        "per_instance": res.per_instance, "failures": res.failures, "error": res.error,
        "target_fingerprint_id": res.target_fingerprint_id, "baseline_fingerprint_id": res.baseline_fingerprint_id,
    }
