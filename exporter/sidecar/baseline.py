"""Baseline images of a probe set, stored per deployment fingerprint with checksums.

Same deployment + same seed gives the same image; across deployments it does
not.  So a baseline belongs to one fingerprint: a probe against another one is
*stale* (no PSNR, no false quality alert), and a rollback finds its old
baseline again.  Layout::

    <root>/<probe set>/<fingerprint_id>/manifest.json
    <root>/<probe set>/<fingerprint_id>/images/<item id>.png          (images)
    <root>/<probe set>/<fingerprint_id>/images/<item id>_f<NNN>.png   (video frames)

A capture is written to a temporary folder and renamed into place, so a failed
capture leaves the previous baseline as it was.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from stepwatch.exporter.sidecar.client import ServiceInfo, decode_png, encode_png
from stepwatch.exporter.sidecar.config import ProbeSet

MANIFEST = "manifest.json"
FORMAT = "stepwatch-baseline/1"
_SAFE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")


class BaselineError(Exception):
    """A baseline that cannot be used: names the file and what is wrong with it."""

    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)
        self.problem = problem


@dataclass
class Baseline:
    directory: Path
    probe_set: str
    probe_set_digest: str
    fingerprint_id: str
    fingerprint: dict[str, Any]
    instance_id: str
    captured_unix: float
    frames: dict[str, list[NDArray[np.uint8]]]
    cost_seconds: float | None = None
    gpus: int = 1
    max_request_seconds: float | None = None
    manifest: dict[str, Any] = field(default_factory=dict, repr=False)


LookupState = Literal["ok", "stale", "missing", "error"]


@dataclass
class Lookup:
    """The baseline for a fingerprint: ``ok``, ``stale`` (only other fingerprints stored),
    ``missing`` (none stored) or ``error`` (stored but unusable)."""

    state: LookupState
    baseline: Baseline | None = None
    error: BaselineError | None = None
    stored: list[str] = field(default_factory=list)


def safe_component(fingerprint_id: str) -> str:
    """A fingerprint id usable as a folder name (hashed when it is not)."""
    if _SAFE.match(fingerprint_id):
        return fingerprint_id
    return "h" + hashlib.sha256(fingerprint_id.encode()).hexdigest()[:16]


def sha256_file(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class BaselineStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def set_dir(self, probe_set: str) -> Path:
        return self.root / probe_set

    def path(self, probe_set: str, fingerprint_id: str) -> Path:
        return self.set_dir(probe_set) / safe_component(fingerprint_id)

    def stored(self, probe_set: str) -> list[str]:
        """Fingerprint folders of a probe set, newest first (leftover temporary folders ignored)."""
        d = self.set_dir(probe_set)
        try:
            dirs = [p for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")]
        except OSError:
            return []

        def mtime(p: Path) -> float:
            try:
                return (p / MANIFEST).stat().st_mtime
            except OSError:
                return 0.0

        return [p.name for p in sorted(dirs, key=mtime, reverse=True)]

    # --- reading -----------------------------------------------------------------------

    def load(self, probe_set: ProbeSet, fingerprint_id: str) -> Baseline:
        """The verified baseline, or ``BaselineError`` naming the file and the problem."""
        d = self.path(probe_set.name, fingerprint_id)
        mpath = d / MANIFEST
        try:
            text = mpath.read_text()
        except FileNotFoundError:
            raise BaselineError(mpath, "missing (the capture did not finish, or the file was removed)") from None
        except OSError as e:
            raise BaselineError(mpath, f"cannot read ({e.strerror})") from None
        try:
            m = json.loads(text)
        except ValueError as e:
            raise BaselineError(mpath, f"not valid JSON ({e})") from None
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise BaselineError(mpath, f"not a stepwatch baseline manifest (format is not {FORMAT!r})")
        if m.get("fingerprint_id") != fingerprint_id and safe_component(str(m.get("fingerprint_id"))) != d.name:
            raise BaselineError(mpath, f"records fingerprint {m.get('fingerprint_id')!r}, "
                                       f"but is stored under {d.name!r}")
        if m.get("probe_set_digest") != probe_set.digest():
            raise BaselineError(mpath, f"captured for a different probe set (digest {m.get('probe_set_digest')}, "
                                       f"configured {probe_set.digest()}): rerun `stepwatch baseline capture`")
        items = m.get("items")
        if not isinstance(items, list):
            raise BaselineError(mpath, "no 'items' list")
        by_id = {str(it.get("id")): it for it in items if isinstance(it, dict)}
        frames: dict[str, list[NDArray[np.uint8]]] = {}
        for item in probe_set.items:
            entry = by_id.get(item.id)
            files = entry.get("files") if entry else None
            if not isinstance(files, list) or not files:
                raise BaselineError(mpath, f"no files recorded for probe {item.id}")
            frames[item.id] = [self._read_frame(d, mpath, f) for f in files]
        cost = _dict(m.get("cost"))
        ps_meta = _dict(m.get("probe_set"))
        try:
            return self._baseline(d, m, ps_meta, cost, frames, probe_set)
        except (TypeError, ValueError) as e:
            raise BaselineError(mpath, f"malformed field ({e})") from None

    @staticmethod
    def _baseline(d: Path, m: dict[str, Any], ps_meta: dict[str, Any], cost: dict[str, Any],
                  frames: dict[str, list[NDArray[np.uint8]]], probe_set: ProbeSet) -> Baseline:
        return Baseline(
            directory=d,
            probe_set=str(ps_meta.get("name", probe_set.name)),
            probe_set_digest=str(m["probe_set_digest"]),
            fingerprint_id=str(m["fingerprint_id"]),
            fingerprint=_dict(m.get("fingerprint")),
            instance_id=str(m.get("instance_id", "")),
            captured_unix=float(m.get("captured_unix", 0.0)),
            frames=frames,
            cost_seconds=_num_or_none(cost.get("seconds")),
            gpus=int(cost.get("gpus", 1)) if isinstance(cost.get("gpus", 1), int) else 1,
            max_request_seconds=_num_or_none(cost.get("max_request_seconds")),
            manifest=m,
        )

    def _read_frame(self, d: Path, mpath: Path, f: Any) -> NDArray[np.uint8]:
        if not isinstance(f, dict) or not isinstance(f.get("path"), str) or not isinstance(f.get("sha256"), str):
            raise BaselineError(mpath, f"bad file entry {f!r}")
        rel = f["path"]
        if rel.startswith("/") or ".." in Path(rel).parts:
            raise BaselineError(mpath, f"file path {rel!r} leaves the baseline folder")
        p = d / rel
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            raise BaselineError(p, "missing (listed in manifest.json)") from None
        except OSError as e:
            raise BaselineError(p, f"cannot read ({e.strerror})") from None
        got = sha256_file(data)
        if got != f["sha256"]:
            raise BaselineError(p, f"checksum mismatch (manifest sha256 {f['sha256'][:12]}..., file {got[:12]}...): "
                                   "the file changed after capture; recapture the baseline")
        try:
            frames = decode_png(data)
        except Exception as e:
            raise BaselineError(p, f"not a readable PNG ({e})") from None
        return frames[0]

    def lookup(self, probe_set: ProbeSet, fingerprint_id: str) -> Lookup:
        """The baseline to compare a deployment with; never raises."""
        stored = self.stored(probe_set.name)
        want = safe_component(fingerprint_id)
        if want in stored:
            try:
                return Lookup("ok", self.load(probe_set, fingerprint_id), None, stored)
            except BaselineError as e:
                return Lookup("error", None, e, stored)
        if not stored:
            err = BaselineError(self.set_dir(probe_set.name),
                                f"no baseline for probe set {probe_set.name!r} "
                                f"(run `stepwatch baseline capture --target URL --out {self.root}`)")
            return Lookup("missing", None, err, stored)
        # Stale: the newest stored one still tells whether the store itself is intact.
        try:
            other = self.load(probe_set, stored[0])
            return Lookup("stale", other, None, stored)
        except BaselineError as e:
            return Lookup("stale", None, e, stored)

    # --- writing -----------------------------------------------------------------------

    def save(self, probe_set: ProbeSet, info: ServiceInfo,
             outputs: Mapping[str, Sequence[NDArray[np.uint8]]], *, target: str = "",
             cost_seconds: float | None = None, max_request_seconds: float | None = None,
             extra: Mapping[str, Any] | None = None) -> Path:
        """Write a baseline atomically; the previous one for this fingerprint is replaced only at the end."""
        missing = [i.id for i in probe_set.items if i.id not in outputs]
        if missing:
            raise ValueError(f"outputs missing for probes {missing}")
        set_dir = self.set_dir(probe_set.name)
        set_dir.mkdir(parents=True, exist_ok=True)
        final = self.path(probe_set.name, info.fingerprint_id)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=set_dir))
        try:
            (tmp / "images").mkdir()
            items = []
            for item in probe_set.items:
                frames = list(outputs[item.id])
                files = []
                for k, frame in enumerate(frames):
                    rel = f"images/{item.id}.png" if len(frames) == 1 and not item.is_video \
                        else f"images/{item.id}_f{k:03d}.png"
                    data = encode_png(frame)
                    (tmp / rel).write_bytes(data)
                    files.append({"path": rel, "sha256": sha256_file(data), "bytes": len(data)})
                items.append({**item.to_dict(), "files": files})
            now = time.time()
            manifest = {
                "format": FORMAT,
                "probe_set": {"name": probe_set.name, "gate": probe_set.gate},
                "probe_set_digest": probe_set.digest(),
                "fingerprint_id": info.fingerprint_id,
                "fingerprint": info.fingerprint,
                "instance_id": info.instance_id,
                "knobs": info.knobs,
                "target": target,
                "captured_unix": now,
                "captured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
                "cost": {"seconds": cost_seconds, "gpus": info.gpus, "max_request_seconds": max_request_seconds},
                "items": items,
                **(dict(extra) if extra else {}),
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
            old = None
            if final.exists():
                old = set_dir / f".old-{final.name}-{int(now * 1000)}"
                final.rename(old)
            tmp.rename(final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _num_or_none(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
