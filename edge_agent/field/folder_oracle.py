# The folder oracle: queries are copied to DIR/queries/<round>/ with an index; answers come from DIR/labels.csv.
from __future__ import annotations

import csv
import dataclasses
import io
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from edge_agent.data.device_data import DeviceData
from edge_agent.data.oracle import Oracle
from edge_agent.field.folder_pool import folder_pool_of
from edge_agent.learning.bundle import file_sha256
from protocol.files import atomic_write_bytes
from protocol.model_spec import CLASS_NAMES

log = logging.getLogger(__name__)

QUERIES_DIR = "queries"
INDEX_FILE = "index.csv"
LABELS_FILE = "labels.csv"
LABELS_HEADER = ("file", "label")


@dataclass(frozen=True)
class Query:
    """One image shown to a person: its copy (`<round>/<name>` under queries/), round, pool index and origin."""

    file: str
    round_id: int
    index: int
    sha256: str
    source: str
    asked_at: float

    @property
    def name(self) -> str:
        """The copy's file name, unique across rounds: what labels.csv refers to."""
        return Path(self.file).name


INDEX_FIELDS = tuple(field.name for field in dataclasses.fields(Query))


def _csv_bytes(header: tuple[str, ...], rows: list[tuple]) -> bytes:
    """CSV text of a header and rows."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buffer.getvalue().encode()


def parse_label(value: str, class_names: tuple[str, ...]) -> int:
    """A class given as its number or its name (case-insensitive) -> its number; ValueError otherwise."""
    value = value.strip()
    lowered = [name.lower() for name in class_names]
    if value.isdigit() and int(value) < len(class_names):
        return int(value)
    if value.lower() in lowered:
        return lowered.index(value.lower())
    raise ValueError(f"label {value!r} is neither a class number 0..{len(class_names) - 1} nor a class name")


class QueryBook:
    """The files a person or labelling tool shares with the agent: queries/index.csv, the copies, and labels.csv.

    labels.csv has rows `file,label` (file: the copy's name or path under queries/; label: class number or name);
    the last row for a file wins. Bad rows are logged once and skipped. Writes are atomic (whole-file replace).
    """

    def __init__(self, oracle_dir: Path | str, class_names: tuple[str, ...] = CLASS_NAMES) -> None:
        self.oracle_dir = Path(oracle_dir)
        self.class_names = class_names
        self.queries_dir = self.oracle_dir / QUERIES_DIR
        self.labels_path = self.oracle_dir / LABELS_FILE
        self._lock = threading.Lock()
        self._reported: set[tuple[str, ...]] = set()

    def queries(self) -> list[Query]:
        """Every query ever asked, in the order asked."""
        path = self.queries_dir / INDEX_FILE
        if not path.is_file():
            return []
        rows = list(csv.DictReader(io.StringIO(path.read_text())))
        try:
            return [
                Query(
                    row["file"],
                    int(row["round_id"]),
                    int(row["index"]),
                    row["sha256"],
                    row["source"],
                    float(row["asked_at"]),
                )
                for row in rows
            ]
        # float() raises ValueError for a damaged query index: the file's damage, named
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: not a query index ({exc})") from exc

    def add(self, new_queries: list[Query]) -> None:
        """Appends queries to the index (their copies must already be in place)."""
        if new_queries:
            rows = [dataclasses.astuple(query) for query in self.queries() + new_queries]
            atomic_write_bytes(self.queries_dir / INDEX_FILE, _csv_bytes(INDEX_FIELDS, rows))

    def image_path(self, query: Query) -> Path:
        """Where the query's copy lives."""
        return self.queries_dir / query.file

    def answers(self) -> dict[str, int]:
        """Query name -> class number, from labels.csv (absent file: no answers)."""
        found: dict[str, int] = {}
        for number, row in self._label_rows():
            try:
                if len(row) != 2:
                    raise ValueError(f"expected 2 columns (file,label), got {len(row)}")
                found[Path(row[0].strip()).name] = parse_label(row[1], self.class_names)
            # parse_label's ValueError: a person's line in labels.csv, reported once and skipped
            except ValueError as error:
                self._report_once(f"{self.labels_path}: line {number} skipped: {error}", tuple(row))
        return found

    def _label_rows(self) -> list[tuple[int, list[str]]]:
        """(line number, cells) of labels.csv's non-empty rows, header left out."""
        if not self.labels_path.is_file():
            return []
        rows = csv.reader(io.StringIO(self.labels_path.read_text(errors="replace")))
        return [
            (number, row)
            for number, row in enumerate(rows, 1)
            if row and tuple(cell.strip().lower() for cell in row) != LABELS_HEADER
        ]

    def pending(self) -> list[Query]:
        """Queries with no answer in labels.csv yet."""
        answered = self.answers()
        return [query for query in self.queries() if query.name not in answered]

    def record_answer(self, name: str, label: int) -> None:
        """Adds one answer to labels.csv at once (whole-file atomic replace); ValueError for an unknown query."""
        if name not in {query.name for query in self.queries()}:
            raise ValueError(f"no query named {name!r}")
        if not 0 <= label < len(self.class_names):
            raise ValueError(f"label {label} is outside 0..{len(self.class_names) - 1}")
        with self._lock:
            rows = [tuple(row) for _, row in self._label_rows()]
            atomic_write_bytes(self.labels_path, _csv_bytes(LABELS_HEADER, rows + [(name, str(label))]))

    def _report_once(self, message: str, key: tuple[str, ...]) -> None:
        """Logs a bad labels.csv row the first time it is seen."""
        if key not in self._reported:
            self._reported.add(key)
            log.warning("%s", message)


class FolderOracle(Oracle):
    """Asks a person through a folder: copies each queried image, then reads their answers from labels.csv.

    label() writes the new queries, waits up to wait_seconds for them to be answered (stop_event ends the wait
    early), then returns every answered query not yet in the labelled store, including answers to queries of
    earlier rounds. Unanswered queries stay pending on disk and are never asked again.
    """

    name = "folder"

    def class_names(self) -> tuple[str, ...]:
        """The names the person's answers are read with (the device's model spec's)."""
        return self.book.class_names

    def __init__(
        self,
        book: QueryBook,
        data: DeviceData,
        wait_seconds: float,
        stop_event: threading.Event | None = None,
        poll_seconds: float = 0.5,
    ) -> None:
        self.book = book
        self.data = data
        self.pool = folder_pool_of(data)
        self.wait_seconds = wait_seconds
        self.stop_event = stop_event or threading.Event()
        self.poll_seconds = poll_seconds
        self.round_id = 0

    def stop_with(self, event: threading.Event) -> None:
        """A wait for answers ends when `event` (its agent's stop) is set."""
        self.stop_event = event

    def start_round(self, round_id: int) -> None:
        """New queries go to queries/<round_id>/."""
        self.round_id = round_id

    def ask(self, indices: np.ndarray) -> list[Query]:
        """Copies the images of indices never asked before into this round's folder and indexes them."""
        asked = {query.index for query in self.book.queries()}
        new_queries = [self._copy(int(index)) for index in indices if int(index) not in asked]
        self.book.add(new_queries)
        if new_queries:
            log.info(
                "queries written round=%d new=%d folder=%s",
                self.round_id,
                len(new_queries),
                self.book.queries_dir / str(self.round_id),
            )
        return new_queries

    def pending(self) -> np.ndarray:
        """Indices asked but not yet in the labelled store."""
        labelled = set(self.data.labelled()[0].tolist())
        return np.array(sorted({q.index for q in self.book.queries()} - labelled), dtype=np.int64)

    def collect(self) -> tuple[np.ndarray, np.ndarray]:
        """(indices, labels) of answered queries not yet in the labelled store."""
        answers = self.book.answers()
        labelled = set(self.data.labelled()[0].tolist())
        found = {q.index: answers[q.name] for q in self.book.queries() if q.name in answers and q.index not in labelled}
        indices = np.array(sorted(found), dtype=np.int64)
        return indices, np.array([found[i] for i in indices.tolist()], dtype=np.int64)

    def label(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Asks for indices, waits up to wait_seconds for their answers, returns everything answered so far."""
        waiting = {query.name for query in self.ask(np.asarray(indices, dtype=np.int64))}
        deadline = time.monotonic() + self.wait_seconds
        while waiting - set(self.book.answers()) and time.monotonic() < deadline:
            if self.stop_event.wait(self.poll_seconds):
                break
        answered = self.collect()
        log.info(
            "answers collected round=%d answered=%d pending=%d",
            self.round_id,
            len(answered[0]),
            len(self.pending()) - len(answered[0]),
        )
        return answered

    def _copy(self, index: int) -> Query:
        """Copies the original file of a pool item (or, if it changed or vanished, its decoded image as PNG)."""
        item = self.pool.item(index)
        source = self.pool.pool_dir / item.path
        intact = source.is_file() and file_sha256(source) == item.sha256
        suffix = Path(item.path).suffix.lower() if intact else ".png"
        file = f"{self.round_id}/{index:06d}-{item.sha256[:12]}{suffix}"
        target = self.book.queries_dir / file
        if intact:
            atomic_write_bytes(target, source.read_bytes())
        else:
            buffer = io.BytesIO()
            Image.fromarray(self.data.images(np.array([index]))[0]).save(buffer, format="PNG")
            atomic_write_bytes(target, buffer.getvalue())
        return Query(file, self.round_id, index, item.sha256, item.path, time.time())
