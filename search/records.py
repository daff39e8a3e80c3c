"""Where measurements are kept: one small store interface, and the JSON-lines store `l2ir bench` writes.

A record is the JSON form of one `Measurement` (search/evaluator.py) plus who it was for: `config` (the candidate's
name) and `origin` (who proposed it). A store answers three things: add a measurement, look up what is done (so a
killed run resumes where it stopped), iterate over everything. The SQLite records DB of the search implements the
same `Store` protocol.

Resume is keyed by (kernel hash, problem text, scenario, artifact key): a record made with another binary (new
flags, new compiler) does not count as done. `lookup(..., artifact_key=None)` takes the latest record for the kernel
whatever binary made it: that is what a report rebuilt without compiling wants.

A finished run may be archived as `<name>.jsonl.gz` (bench/results keeps superseded raw runs that way, so the tree
that travels to the GPU machine stays small): every reader takes it as the plain file; nothing appends to it.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Iterator, Protocol


class Store(Protocol):
    def add(self, measurement, name: str = "", origin: str = "") -> dict:
        """Record one Measurement; returns the record as stored."""

    def lookup(self, kernel_hash: str, problem: str, scenario: str, artifact_key: str | None = None) -> dict | None:
        """The latest record for this kernel, problem and scenario (and binary, unless artifact_key is None)."""

    def __iter__(self) -> Iterator[dict]:
        """Every record, in the order they were added."""


def record_of(measurement, name: str = "", origin: str = "") -> dict:
    """The stored form of a Measurement: its JSON plus the candidate's name and origin."""
    rec = measurement.to_json()
    rec["config"] = name
    if origin:
        rec["origin"] = origin
    return rec


def passed(rec: dict) -> bool:
    """Every gate ran and passed, and nothing went wrong around them."""
    return not rec.get("errors") and bool(rec.get("verdicts")) and all(v["passed"] for v in rec["verdicts"])


def first_failure(rec: dict) -> str:
    """The first error or failed gate of a record, for a one-line log."""
    if rec.get("errors"):
        return rec["errors"][0]
    for v in rec.get("verdicts", []):
        if not v["passed"]:
            return f"gate {v['name']}: {v.get('detail', '')}"
    return "no verdicts"


def _key(rec: dict) -> tuple[str, str, str]:
    return rec["kernel_hash"], rec["problem"], rec["scenario"]


class MemoryStore:
    """Records in a list: a store for tests and for runs that keep nothing."""

    def __init__(self, records: list[dict] | None = None):
        self._records: list[dict] = []
        self._latest: dict[tuple, dict] = {}
        for rec in records or []:
            self._index(rec)

    def _index(self, rec: dict) -> None:
        try:
            key = _key(rec)
        except (KeyError, TypeError):
            return                 # not a measurement (a note, a cut line): kept out of the index
        self._records.append(rec)
        self._latest[key + (rec.get("artifact_key", ""),)] = rec
        self._latest[key] = rec    # the latest for the kernel whatever binary made it

    def add(self, measurement, name: str = "", origin: str = "") -> dict:
        rec = record_of(measurement, name, origin)
        self._index(rec)
        return rec

    def lookup(self, kernel_hash: str, problem: str, scenario: str, artifact_key: str | None = None) -> dict | None:
        key = (kernel_hash, problem, scenario)
        return self._latest.get(key if artifact_key is None else key + (artifact_key,))

    def __iter__(self) -> Iterator[dict]:
        return iter(list(self._records))

    def __len__(self) -> int:
        return len(self._records)


def read_results_text(path: str | Path) -> str:
    """The text of a results file, decompressed when it is an archived `.gz` one."""
    path = Path(path)
    if path.suffix == ".gz":
        with gzip.open(path, "rt") as fh:
            return fh.read()
    return path.read_text()


def unarchived(path: str | Path) -> Path:
    """The path a results file had before it was archived: `run.jsonl.gz` -> `run.jsonl`."""
    path = Path(path)
    return path.with_suffix("") if path.suffix == ".gz" else path


def results_file(path: str | Path) -> Path:
    """The file to read for a results path: the path itself, or its archive `<path>.gz` where only that exists."""
    path = Path(path)
    archive = path.with_name(path.name + ".gz")
    return archive if path.suffix != ".gz" and not path.exists() and archive.exists() else path


class JsonlStore(MemoryStore):
    """One JSON object per line, appended and flushed as each measurement is made: a run killed mid-write loses at
    most the line being written, and a cut line is skipped when the file is read back."""

    def __init__(self, path: str | Path, resume: bool = True):
        self.path = results_file(path)      # run.jsonl, or its archive run.jsonl.gz where only that exists
        if self.path.suffix == ".gz" and not resume:
            raise ValueError(f"{self.path}: an archived run is read-only; it cannot be restarted")
        records = []
        if resume and self.path.exists():
            for line in read_results_text(self.path).splitlines():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue       # a line cut by a kill mid-write
        elif not resume and self.path.exists():
            self.path.unlink()
        super().__init__([r for r in records if isinstance(r, dict)])

    def add(self, measurement, name: str = "", origin: str = "") -> dict:
        if self.path.suffix == ".gz":
            raise ValueError(f"{self.path}: an archived run is read-only; write a new run elsewhere")
        rec = super().add(measurement, name, origin)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as fh:
            fh.write(json.dumps(rec) + "\n")
        return rec
