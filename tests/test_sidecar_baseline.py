"""The baseline store: round trip, checksums, missing and corrupted files, fingerprints."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stepwatch.exporter.sidecar import baseline as baseline_mod
from stepwatch.exporter.sidecar.baseline import MANIFEST, BaselineStore, safe_component
from stepwatch.exporter.sidecar.client import ServiceInfo
from stepwatch.exporter.sidecar.config import ProbeItem, ProbeSet
from tests.fakes import image_for

PS = ProbeSet("tiny", (ProbeItem("000", "a fox", 0, "32x32", 4), ProbeItem("001", "a fox", 1, "32x32", 4),
                       ProbeItem("002", "a clip", 2, "32x16", 4, frames=3)), "lossy_ii")
INFO = ServiceInfo("inst-a", {"model": "m", "ranks": 2}, "fp0000000000000a", {"cache": "none"}, True)


def outputs() -> dict[str, list[np.ndarray]]:
    out = {}
    for it in PS.items:
        w, h = it.width_height
        out[it.id] = [image_for(it.prompt, it.seed, w, h, it.steps, f) for f in range(it.frames or 1)]
    return out


def saved(tmp_path: Path) -> tuple[BaselineStore, Path]:
    store = BaselineStore(tmp_path)
    return store, store.save(PS, INFO, outputs(), target="http://x", cost_seconds=0.3, max_request_seconds=0.2)


def test_round_trip(tmp_path: Path) -> None:
    store, path = saved(tmp_path)
    assert path == tmp_path / "tiny" / "fp0000000000000a"
    assert sorted(p.name for p in (path / "images").iterdir()) == [
        "000.png", "001.png", "002_f000.png", "002_f001.png", "002_f002.png"]
    m = json.loads((path / MANIFEST).read_text())
    assert m["fingerprint"] == {"model": "m", "ranks": 2} and m["fingerprint_id"] == "fp0000000000000a"
    assert m["cost"] == {"seconds": 0.3, "gpus": 2, "max_request_seconds": 0.2}
    assert len(m["items"][0]["files"][0]["sha256"]) == 64
    b = store.load(PS, "fp0000000000000a")
    for k, frames in outputs().items():
        assert len(b.frames[k]) == len(frames)
        for x, y in zip(b.frames[k], frames, strict=True):
            assert np.array_equal(x, y)
    assert (b.fingerprint_id, b.instance_id, b.cost_seconds, b.gpus) == ("fp0000000000000a", "inst-a", 0.3, 2)
    lk = store.lookup(PS, "fp0000000000000a")
    assert lk.state == "ok" and lk.error is None


def test_corrupted_file_is_a_clear_error(tmp_path: Path) -> None:
    store, path = saved(tmp_path)
    f = path / "images" / "001.png"
    raw = bytearray(f.read_bytes())
    raw[-20] ^= 0xFF
    f.write_bytes(bytes(raw))
    lk = store.lookup(PS, "fp0000000000000a")
    assert lk.state == "error" and lk.baseline is None
    assert lk.error is not None and lk.error.path == f
    assert "checksum mismatch" in str(lk.error) and str(f) in str(lk.error)


def test_missing_file_and_missing_manifest(tmp_path: Path) -> None:
    store, path = saved(tmp_path)
    (path / "images" / "002_f001.png").unlink()
    lk = store.lookup(PS, "fp0000000000000a")
    assert lk.state == "error" and "002_f001.png: missing" in str(lk.error)
    (path / MANIFEST).unlink()
    lk = store.lookup(PS, "fp0000000000000a")
    assert lk.state == "error" and f"{path / MANIFEST}: missing" in str(lk.error)


def test_bad_manifest_json_and_wrong_probe_set(tmp_path: Path) -> None:
    store, path = saved(tmp_path)
    other = ProbeSet("tiny", PS.items[:2], "lossy_ii")
    lk = store.lookup(other, "fp0000000000000a")
    assert lk.state == "error" and "different probe set" in str(lk.error)
    (path / MANIFEST).write_text("{not json")
    lk = store.lookup(PS, "fp0000000000000a")
    assert lk.state == "error" and "not valid JSON" in str(lk.error)


def test_no_baseline_is_missing(tmp_path: Path) -> None:
    lk = BaselineStore(tmp_path / "nowhere").lookup(PS, "fp0000000000000a")
    assert lk.state == "missing" and "no baseline for probe set 'tiny'" in str(lk.error)
    assert "stepwatch baseline capture" in str(lk.error)


def test_other_fingerprint_is_stale_and_rollback_finds_its_baseline(tmp_path: Path) -> None:
    store, _ = saved(tmp_path)
    lk = store.lookup(PS, "fp00000000000new")
    assert lk.state == "stale" and lk.stored == ["fp0000000000000a"]
    assert lk.baseline is not None and lk.error is None  # the stored one is intact
    new = ServiceInfo("inst-b", {"model": "m2"}, "fp00000000000new")
    store.save(PS, new, outputs())
    assert store.lookup(PS, "fp00000000000new").state == "ok"
    assert store.lookup(PS, "fp0000000000000a").state == "ok"  # both kept


def test_failed_capture_leaves_the_old_baseline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store, path = saved(tmp_path)
    before = (path / MANIFEST).read_text()
    calls = [0]
    real = baseline_mod.encode_png

    def flaky(frame: np.ndarray) -> bytes:
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(28, "No space left on device")
        return real(frame)

    monkeypatch.setattr(baseline_mod, "encode_png", flaky)
    with pytest.raises(OSError):
        store.save(PS, INFO, outputs())
    assert (path / MANIFEST).read_text() == before
    assert store.lookup(PS, INFO.fingerprint_id).state == "ok"
    assert [p.name for p in (tmp_path / "tiny").iterdir()] == ["fp0000000000000a"]  # no temporary leftovers


def test_unsafe_fingerprint_ids_become_safe_folder_names(tmp_path: Path) -> None:
    assert safe_component("abc123") == "abc123"
    bad = safe_component("../../etc")
    assert "/" not in bad and bad.startswith("h")
    store = BaselineStore(tmp_path)
    p = store.save(PS, ServiceInfo("i", {}, "../../etc"), outputs())
    assert p.parent == tmp_path / "tiny"
    assert store.lookup(PS, "../../etc").state == "ok"
