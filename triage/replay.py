"""Replay a recorded scenario: backfill its samples into a fresh TSDB and serve them with a real Prometheus.

    with Replay(Path("triage/scenarios/straggler-1"), workdir) as rp:
        triage(rp.alerts(), rp.prom, at=rp.evaluated_at)

No rules are loaded (the recording rules' output is in the samples already) and
nothing is scraped; retention is long so that old timestamps are never dropped.
A backfill has no staleness markers, so a series that ended (an info metric's
old label set, a resolved alert) would stay visible for Prometheus' 5-minute
lookback; the replay's lookback is three scrape intervals of the recording
instead, which is when a live Prometheus would have marked it stale.
"""

from __future__ import annotations

import gzip
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from stepwatch.procs import Child, free_port
from stepwatch.promapi import PromError, Prometheus
from stepwatch.triage.record import SAMPLES_FILE, load_scenario

__all__ = ["Replay", "ReplayError"]


class ReplayError(RuntimeError):
    pass


class Replay:
    """A Prometheus on loopback serving one scenario's samples; stopped on exit."""

    def __init__(self, scenario_dir: str | Path, workdir: str | Path | None = None, timeout: float = 60.0) -> None:
        self.dir = Path(scenario_dir)
        self.scenario: dict[str, Any] = load_scenario(self.dir)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="stepwatch-replay-")
            workdir = self._tmp.name
        self.workdir = Path(workdir)
        self.timeout = timeout
        self.proc: Child | None = None
        self.url = ""
        self.prom: Prometheus

    @property
    def evaluated_at(self) -> float:
        return float(self.scenario["evaluated_at"])

    @property
    def lookback(self) -> str:
        scrape = float(self.scenario.get("scrape_interval_s") or 0)
        return f"{max(15, int(3 * scrape))}s" if scrape else "5m"

    @property
    def samples_file(self) -> Path:
        """Its own samples, or those of the scenario it names in ``samples_from`` (a false alarm on a control)."""
        other = self.scenario.get("samples_from")
        return self.dir.parent / str(other) / SAMPLES_FILE if other else self.dir / SAMPLES_FILE

    def alerts(self) -> list[dict[str, Any]]:
        return list(self.scenario.get("alerts") or [])

    def start(self) -> Replay:
        """Backfill and start Prometheus; on any failure (Ctrl-C included) nothing is left behind."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> Replay:
        for tool in ("promtool", "prometheus"):
            if shutil.which(tool) is None:
                raise ReplayError(f"{tool} not found (Debian package prometheus)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        data = self.workdir / "data"
        om = self.workdir / "samples.om"
        with gzip.open(self.samples_file, "rb") as src, open(om, "wb") as dst:
            shutil.copyfileobj(src, dst)
        try:
            r = subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", "--quiet", str(om),
                                str(data)], capture_output=True, text=True, timeout=300)
        finally:
            om.unlink(missing_ok=True)
        if r.returncode != 0:
            raise ReplayError(f"promtool backfill of {self.dir.name} failed: {r.stderr.strip() or r.stdout.strip()}")
        cfg = self.workdir / "prometheus.yml"
        cfg.write_text("global:\n  scrape_interval: 1h\n")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc = Child("prometheus", [
            "prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=100y",
            f"--query.lookback-delta={self.lookback}", "--log.level=warn"], self.workdir / "prometheus.log")
        self.prom = Prometheus(self.url, timeout=10.0)
        deadline = time.time() + self.timeout
        while time.time() < deadline:
            if not self.proc.alive():
                raise ReplayError(f"prometheus exited with {self.proc.proc.returncode}: {self.proc.tail(2000)}")
            if self.prom.ready():
                try:
                    self.prom.query("vector(1)")
                    return self
                except PromError:
                    pass
            time.sleep(0.1)
        raise ReplayError(f"prometheus on {self.dir.name} not ready in {self.timeout:.0f}s")

    def stop(self) -> None:
        """Stop Prometheus and remove the temporary work directory; safe to call more than once."""
        proc, self.proc = self.proc, None
        prom = self.__dict__.pop("prom", None)  # set once _start got that far
        try:
            if prom is not None:
                prom.close()
            if proc is not None:
                proc.stop(timeout=15)
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()
                self._tmp = None

    def __enter__(self) -> Replay:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
