# The folder oracle: queries are copied to DIR/queries/<round>/ and recorded in the device's query store
# (DIR/answers.sqlite), where answers and corrections arrive by any road (labels.csv's rows delivered as they change).
from __future__ import annotations

import csv
import io
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from edge_agent.data.device_data import DeviceData
from edge_agent.data.oracle import Guess, Oracle
from edge_agent.data.query_records import DECLINED, Delivery, LabelKind, Query, Road
from edge_agent.data.query_schema import INDEX_FILE, INDEX_HEADER, QUERIES_DIR, STORE_FILE
from edge_agent.data.query_store import QueryStore
from edge_agent.field.folder_pool import folder_pool_of
from edge_agent.learning.bundle import file_sha256
from protocol.files import atomic_write_bytes
from protocol.model_spec import CLASS_NAMES

log = logging.getLogger(__name__)

LABELS_FILE = "labels.csv"
LABELS_HEADER = ("file", "label")
RACY_SECONDS = 2.0  # a labels.csv changed this recently is read again even when its size and time look unchanged


def index_lines(queries: list[Query], header: bool) -> bytes:
    """queries/index.csv's lines for these queries (its header first when `header`)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    if header:
        writer.writerow(INDEX_HEADER)
    writer.writerows(query.row()[:6] for query in queries)
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
    """The files a person or labelling tool shares with the agent (the copies under queries/, the list of them in
    queries/index.csv, labels.csv) over the device's query store (answers.sqlite), which holds each query's record
    and every answer, whichever road it came by.

    labels.csv has rows `file,label` (file: the copy's name or path under queries/; label: class number or name);
    of the rows one read finds for a file the last wins, and it is delivered to the store, where the first answer
    stored for a query stays; a row changed after labels.csv's answer was stored corrects it (while the label the
    query carries is still labels.csv's: another road's later word is not undone by an old row). The file is read
    again only when it changed (its size or time; RACY_SECONDS after a change, each time). Bad rows are logged once
    and skipped. index.csv is written for people and tools (a line appended per query) and never read back.
    """

    def __init__(self, oracle_dir: Path | str, class_names: tuple[str, ...] = CLASS_NAMES) -> None:
        self.oracle_dir = Path(oracle_dir)
        self.class_names = class_names
        self.queries_dir = self.oracle_dir / QUERIES_DIR
        self.labels_path = self.oracle_dir / LABELS_FILE
        self._reported: set[tuple[str, ...]] = set()
        self._labels_seen: tuple[int, int] | None = None
        self.store = QueryStore(self.oracle_dir / STORE_FILE)

    def queries(self) -> list[Query]:
        """Every query ever asked, in the order asked."""
        return self.store.queries()

    def add(self, new_queries: list[Query]) -> None:
        """Records queries in the store (their copies must already be in place) and lists them in index.csv."""
        if new_queries:
            self.store.add(new_queries)
            index = self.queries_dir / INDEX_FILE
            with index.open("ab") as listing:
                listing.write(index_lines(new_queries, header=listing.tell() == 0))

    def image_path(self, query: Query) -> Path:
        """Where the query's copy lives."""
        return self.queries_dir / query.file

    def answers(self) -> dict[str, int]:
        """Query name -> class number of every answered query (labels.csv's new rows delivered first); a query
        answered 'none of these' is left out."""
        return {name: label for name, label in self.stored_answers().items() if label != DECLINED}

    def stored_answers(self) -> dict[str, int]:
        """Query name -> the label it carries (DECLINED included), after delivering labels.csv's new and changed
        rows to the store."""
        self.read_labels_csv()
        stored = self.store.labels()
        return {query.name: stored[query.query_id] for query in self.queries() if query.query_id in stored}

    def read_labels_csv(self) -> None:
        """Delivers labels.csv's new and changed rows to the store, when the file changed since it was last read."""
        seen = self._labels_signature()
        if seen is not None and seen == self._labels_seen:
            return
        self._labels_seen = seen
        current = self.store.current()
        by_name = {query.name: query for query in self.queries()}
        for name, label in self.csv_answers().items():
            query = by_name.get(name)
            if query is None:
                continue
            held = current.get(query.query_id)
            if held is None:
                self.store.deliver(query.query_id, label, Road.LABELS_CSV)
            elif held[1] == Road.LABELS_CSV and held[0] != label:
                self.store.deliver(query.query_id, label, Road.LABELS_CSV, kind=LabelKind.CORRECTION)

    def _labels_signature(self) -> tuple[int, int] | None:
        """labels.csv's (size, time of change), or None when it must be read whatever it looks like (changed in the
        last RACY_SECONDS: a second write in the same clock tick leaves size and time alike) or is missing."""
        try:
            status = self.labels_path.stat()
        except FileNotFoundError:
            return (-1, -1)
        if time.time() - status.st_mtime < RACY_SECONDS:
            return None
        return status.st_size, status.st_mtime_ns

    def csv_answers(self) -> dict[str, int]:
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
        """Queries with no stored answer yet."""
        self.read_labels_csv()
        return self.store.unanswered()

    def declined(self) -> set[int]:
        """Pool indices of the queries answered 'none of these' (never labelled, never asked again)."""
        stored = self.store.labels()
        return {query.index for query in self.queries() if stored.get(query.query_id) == DECLINED}

    def record_answer(
        self,
        name: str,
        label: int,
        road: Road = Road.PAGE,
        answered_by: str = "",
        answered_at: float = 0.0,
        kind: LabelKind = LabelKind.ANSWER,
        revision: int = 0,
    ) -> Delivery:
        """Delivers one answer or correction to the store (durable when it returns; a repeated delivery changes
        nothing); `name` is the query's copy name or its id; ValueError for an unknown query or a label outside the
        classes (DECLINED: none of these)."""
        query = self.store.query(name)
        if query is None:
            raise ValueError(f"no query named {name[:80]!r}")
        if not (0 <= label < len(self.class_names) or label == DECLINED):
            raise ValueError(f"label {label} is outside 0..{len(self.class_names) - 1}")
        return self.store.deliver(query.query_id, label, road, answered_by, answered_at, kind, revision)

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
        self.keeps_guesses = False  # set by the central labelling queue, which sends each query with its guess
        self._guesses: dict[int, Guess] = {}  # the guesses noted for the samples about to be asked
        self.waiting: Callable[[bool], None] = lambda waits: None

    def wants_guesses(self) -> bool:
        """Whether queries go to the fleet's labelling queue with the model's guess."""
        return self.keeps_guesses

    def note_guesses(self, indices: np.ndarray, guesses: list[Guess]) -> None:
        """Keeps the model's guess of each sample about to be asked, for the query record it becomes."""
        self._guesses.update(zip(indices.tolist(), guesses))

    def notify_wait(self, waiting: Callable[[bool], None]) -> None:
        """`waiting(True)` is called when a wait for a person's answers starts, `waiting(False)` when it ends."""
        self.waiting = waiting

    def stop_with(self, event: threading.Event) -> None:
        """A wait for answers ends when `event` (its agent's stop) is set."""
        self.stop_event = event

    def start_round(self, round_id: int) -> None:
        """New queries go to queries/<round_id>/."""
        self.round_id = round_id

    def ask(self, indices: np.ndarray) -> list[Query]:
        """Copies the images of indices never asked before into this round's folder and records them (with the
        guesses noted for them)."""
        asked = self.book.store.asked_indices()
        new_queries = [self._copy(int(index)) for index in indices if int(index) not in asked]
        self.book.add(new_queries)
        self._guesses.clear()
        if new_queries:
            log.info(
                "queries written round=%d new=%d folder=%s",
                self.round_id,
                len(new_queries),
                self.book.queries_dir / str(self.round_id),
            )
        return new_queries

    def pending(self) -> np.ndarray:
        """Indices asked but neither in the labelled store nor answered 'none of these'."""
        labelled = set(self.data.labelled()[0].tolist())
        asked = self.book.store.asked_indices()
        return np.array(sorted(asked - labelled - self.book.declined()), dtype=np.int64)

    def collect(self) -> tuple[np.ndarray, np.ndarray]:
        """(indices, labels) of answered queries not yet in the labelled store whose label no correction set (those
        `correct` takes in), noted in the store as taken."""
        answers = self.book.answers()
        corrected = self.book.store.corrected()
        labelled = set(self.data.labelled()[0].tolist())
        found = {
            q.index: answers[q.name]
            for q in self.book.queries()
            if q.name in answers and q.index not in labelled and q.query_id not in corrected
        }
        indices = np.array(sorted(found), dtype=np.int64)
        self.book.store.note_taken(indices.tolist())
        return indices, np.array([found[i] for i in indices.tolist()], dtype=np.int64)

    def correct(self) -> int:
        """Brings the labelled store in line with the query store's corrections: a corrected label replaces the one
        held or joins the store (tagged `correction`), a correction to 'none of these' takes the sample out, so the
        next training uses the corrected label and a corrected label counts once; how many samples changed."""
        corrected = self.book.store.corrected()
        if not corrected:
            return 0
        current = self.book.store.labels()
        queries = [query for query in self.book.queries() if query.query_id in corrected]
        indices = np.array([query.index for query in queries], dtype=np.int64)
        wanted = np.array([current[query.query_id] for query in queries], dtype=np.int64)
        changed = self.data.labels_at(indices) != wanted
        if changed.any():
            self.data.correct_labels(indices[changed], wanted[changed])
            self.book.store.note_taken(indices[changed].tolist())
            log.info("corrections applied labels=%d", int(changed.sum()))
        return int(changed.sum())

    def label(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Asks for indices, waits up to wait_seconds for their answers (saying so through `waiting`), takes in the
        corrections stored meanwhile, returns everything newly answered."""
        waiting = {query.name for query in self.ask(np.asarray(indices, dtype=np.int64))}
        deadline = time.monotonic() + self.wait_seconds
        waits = self._unanswered(waiting) and self.wait_seconds > 0
        if waits:
            self.waiting(True)
        while self._unanswered(waiting) and time.monotonic() < deadline:
            if self.stop_event.wait(self.poll_seconds):
                break
        if waits:
            self.waiting(False)
        self.correct()
        answered = self.collect()
        log.info(
            "answers collected round=%d answered=%d pending=%d",
            self.round_id,
            len(answered[0]),
            len(self.pending()) - len(answered[0]),
        )
        return answered

    def _unanswered(self, names: set[str]) -> bool:
        """Whether any of these queries (by copy name) has no answer yet."""
        return any(query.name in names for query in self.book.pending())

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
        return Query(file, self.round_id, index, item.sha256, item.path, time.time(), self._guesses.get(index))
