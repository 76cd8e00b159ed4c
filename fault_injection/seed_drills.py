"""The seeds' three drills: a cache threshold past the quality gate, off-menu resolutions, VAE tiling off."""

from __future__ import annotations

import threading
import time

from stepwatch.fault_injection import queries
from stepwatch.fault_injection.drill import Drill, DrillResult, _mean_step, _quantiles, _rate_window, _scrape_s
from stepwatch.fault_injection.stack import LocalStack
from stepwatch.thresholds import parse_duration


class CacheThreshold(Drill):
    name = "cache-threshold"
    doc_id = "cache_past_gate"
    companions = ("cache_hit_rate_shift",)
    silent = ("step_time_regression",)
    description = ("The cross-step cache threshold is pushed past the quality gate: images degrade while "
                   "every performance panel looks normal or better. Only the quality probe can see it.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        r.details["serving_knobs"] = stack.info()["knobs"]
        r.details["step_seconds_before"] = _mean_step(stack, self.th)
        stack.knobs(**self.inject_knobs())
        r.notes.append(f"knobs {self.inject_knobs()}: every step but the first and the last reuses the cache")

    def while_firing(self, stack: LocalStack, r: DrillResult) -> None:
        p10 = stack.prom.value(queries.psnr_p10())
        gate = stack.prom.value(queries.quality_gate())
        r.details["psnr_p10_db"] = p10
        r.details["gate_db"] = gate
        r.details["step_seconds_during"] = _mean_step(stack, self.th)
        before, during = r.details.get("step_seconds_before"), r.details["step_seconds_during"]
        r.checks["psnr_below_gate_minus_margin"] = (p10 is not None and gate is not None
                                                    and p10 < gate - self.th.quality.alert_margin_db)
        r.checks["performance_normal_or_better"] = bool(before and during
                                                        and during <= before * self.criteria.step_time_at_most)

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        stack.knobs(**self.restore_knobs(r.details.get("serving_knobs", {})))


class OffMenuResolution(Drill):
    name = "off-menu-resolution"
    doc_id = "off_menu_resolutions"
    companions = ("queue_wait", "step_time_regression", "probe_failing")
    description = ("A batch of resolutions that are not on the warm-up list: each compiles while serving, "
                   "so p99 jumps while p50 stays flat.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        r.details["latency_before"] = _quantiles(stack, self.th)
        r.details["_t0"] = time.time()
        codes: list[int] = []
        sizes = list(self.spec.traffic.get("sizes", []))
        per = int(self.spec.traffic.get("requests_per_size", 1))
        spacing = parse_duration(str(self.spec.traffic.get("spacing", "0s")))

        def batch() -> None:
            for n, size in enumerate(s for s in sizes for _ in range(per)):
                if n and spacing:
                    time.sleep(spacing)  # off-menu requests arrive among the others, not as one block
                st, _, _ = stack.generate(size=size, seed=n % per)
                codes.append(st)

        t = threading.Thread(target=batch, daemon=True)
        t.start()
        r.details["_batch"] = t
        r.details["off_menu_codes"] = codes
        r.notes.append(f"sent {', '.join(sizes)} (not on the warm-up list)")

    def while_firing(self, stack: LocalStack, r: DrillResult) -> None:
        t = r.details.pop("_batch", None)
        if t is not None:
            t.join(timeout=300)
        time.sleep(2 * _scrape_s(self.th))
        after = _quantiles(stack, self.th)
        before = r.details["latency_before"]
        r.details["latency_during"] = after
        r.checks["off_menu_requests_served"] = all(c == 200 for c in r.details["off_menu_codes"])
        rise = self.criteria.p99_rises_above
        r.checks["p99_rises"] = bool(before["p99"] and after["p99"] and after["p99"] > rise * before["p99"])
        r.checks["p50_flat"] = self._p50_flat(stack, r, r.details.pop("_t0", time.time()))
        fired = [a for a in stack.prom.firing() if self.expected_alert_matches(a)]
        r.details["culprit_shapes"] = sorted({a["labels"].get("shape", "") for a in fired})

    def _p50_flat(self, stack: LocalStack, r: DrillResult, t0: float, now: float | None = None) -> bool:
        """The baseline clients' median latency per size, during the off-menu batch vs the rate window before
        it: every size under ``p50_stays_below`` times its own.  Per size and from the clients: the service's
        histogram p50 over the two-size mix sits between the sizes' modes (0.79 s between ~0.5 and ~1.0) and
        jumps to 1.30 s when the mix shifts, with neither size's requests 1.5x slower."""
        traffic = stack.active_traffic
        if traffic is None:
            return False
        window = parse_duration(_rate_window(self.th, stack))
        before = traffic.median_by_size(t0 - window, t0)
        during = traffic.median_by_size(t0, time.time() if now is None else now)
        r.details["baseline_p50_by_size"] = {s: {"before": round(b[0], 4), "during": round(during[s][0], 4),
                                                 "requests": [b[1], during[s][1]]}
                                             for s, b in before.items() if s in during}
        rows = [(during[s][0], b[0]) for s, b in before.items() if s in during and b[1] >= 3 and during[s][1] >= 3]
        flat = self.criteria.p50_stays_below
        return bool(rows) and all(d < flat * b for d, b in rows)

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        r.details.pop("_t0", None)  # the alert never fired: no p50 to judge
        t = r.details.pop("_batch", None)
        if t is not None:
            t.join(timeout=300)


class VaeTilingOom(Drill):
    name = "vae-tiling-oom"
    doc_id = "vae_tiling_off"
    companions = ("probe_failing", "error_ratio")  # the OOM is a 5xx; triage groups it with the OOM
    # The fault's own 2048^2 requests hold the one worker for seconds: the queue sheds the baseline clients
    # with 429 + Retry-After while they run (admission doing its job; measured: 4 of ~100 on the practice stack).
    baseline_accepts = frozenset({200, 429})
    description = ("VAE tiling off and a 2048^2 request: the VAE decode needs more memory than the worker has. "
                   "The memory alert fires, that request fails with a clear error, the instance keeps serving.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        info = stack.info()
        r.details["worker_rss_before"] = info["worker"]["rss_bytes"]
        r.details["worker_pid_before"] = info["worker"]["pid"]
        stack.knobs(**self.inject_knobs())
        tr = self.spec.traffic
        size = tr["sizes"][0]
        status, body, _ = stack.generate(size=size, steps=int(tr.get("steps", 1)))
        msg = body.get("error", {}).get("message", "") if isinstance(body, dict) else str(body)
        r.details["oom_status"] = status
        r.details["oom_message"] = msg
        r.checks["oom_request_fails_with_507"] = status == 507
        r.checks["oom_message_names_stage_shape_fix"] = ("vae_decode" in msg and size in msg
                                                         and "fix:" in msg and "tiling" in msg)
        then = tr.get("then", {})
        st2, _, _ = stack.generate(size=then.get("sizes", ["256x256"])[0])
        r.checks["next_request_succeeds"] = st2 == int(then.get("expect_status", 200))

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        stack.knobs(**self.restore_knobs({}))

    def after(self, stack: LocalStack, r: DrillResult) -> None:
        self.check_same_worker_memory_back(stack, r)
        tr = self.spec.traffic  # the request that failed untiled fits once tiling is back
        st, _, _ = stack.generate(size=tr["sizes"][0], steps=int(tr.get("steps", 1)))
        r.checks["2048_fits_with_tiling"] = st == 200
