# The field's test set: the answered field test queries of a run's labelling queue, with their image files.
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from coordinator.labelling.queue_schema import DATABASE, FIELD_SET, IMAGES, QUEUE_FOLDER, QUEUE_SCHEMA, SUFFIXES
from protocol.sqlite_store import open_store, schema_version


@dataclass(frozen=True)
class FieldAnswer:
    """One image of the field's test set: its query, its image file and the class people gave it."""

    device: str
    query_id: str
    path: Path
    label: int

    @property
    def key(self) -> str:
        """The image's key, unique in the queue."""
        return f"{self.device}/{self.query_id}"


def image_file(folder: Path, device: str, query_id: str, media_type: str) -> Path:
    """Where a query's image is kept under the queue's folder."""
    return folder / IMAGES / device / f"{query_id}{SUFFIXES[media_type]}"


def field_answers(folder: Path, rows: list[tuple]) -> list[FieldAnswer]:
    """FIELD_SET's rows as FieldAnswers."""
    return [
        FieldAnswer(str(device), str(query_id), image_file(folder, device, query_id, media_type), int(label))
        for device, query_id, media_type, label in rows
    ]


def read_field_set(run_dir: Path) -> list[FieldAnswer]:
    """The field's test set of a run's queue, read beside the desk that writes it (nothing is created or changed):
    none while the run keeps no queue, or keeps one its desk has not brought up to this schema yet."""
    path = Path(run_dir) / QUEUE_FOLDER / DATABASE
    if not path.is_file():
        return []
    connection = open_store(path, QUEUE_SCHEMA, read_only=True)
    try:
        rows = connection.execute(FIELD_SET).fetchall() if schema_version(connection) == QUEUE_SCHEMA.version else []
    finally:
        connection.close()
    return field_answers(path.parent, rows)
