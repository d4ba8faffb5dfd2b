# The queue as Label Studio JSON tasks (image choices: the model's guess as a prediction, answers as annotations)
# and Label Studio's annotations read back as answers.
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.labelling.queue import LabelQueue
from coordinator.labelling.queue_records import AnswerError, Correction, Decided, Outcome, QueuedQuery
from protocol import wire
from protocol.errors import UsageError
from protocol.label_messages import NO_GUESS, NONE_OF_THESE

FROM_NAME = "label"
TO_NAME = "image"
NONE_CHOICE = "none of these"


def choice_result(name: str) -> list[dict[str, Any]]:
    """A Label Studio result list holding one choice."""
    return [{"from_name": FROM_NAME, "to_name": TO_NAME, "type": "choices", "value": {"choices": [name]}}]


def labelling_config(class_names: tuple[str, ...]) -> str:
    """The Label Studio labelling config the tasks fit: an image and one single choice among the classes."""
    choices = "".join(f'<Choice value="{name}"/>' for name in (*class_names, NONE_CHOICE))
    return (
        f'<View><Image name="{TO_NAME}" value="$image"/><Choices name="{FROM_NAME}" toName="{TO_NAME}" '
        f'choice="single" showInline="true">{choices}</Choices></View>'
    )


def class_name(queue: LabelQueue, label: int) -> str:
    """A label as the choice Label Studio shows."""
    return NONE_CHOICE if label == NONE_OF_THESE else queue.class_names[label]


def task_of(queue: LabelQueue, query: QueuedQuery, image_url: str, number: int) -> dict[str, Any]:
    """One query as a Label Studio task: its image, device and id in `data`, the guess as a prediction, the
    answer (if any) as an annotation."""
    task: dict[str, Any] = {
        "id": number,
        "data": {"image": image_url, "device": query.device, "query_id": query.query_id},
    }
    if query.guess != NO_GUESS:
        task["predictions"] = [
            {
                "model_version": "edge-fal",
                "score": query.probability,
                "result": choice_result(class_name(queue, query.guess)),
            }
        ]
    if query.label is not None:
        task["annotations"] = [
            {"result": choice_result(class_name(queue, query.label)), "completed_by": query.answered_by}
        ]
    return task


def export_tasks(queue: LabelQueue, out_dir: Path, url_prefix: str, only_open: bool) -> list[dict[str, Any]]:
    """The queue's queries as tasks, their images copied to out_dir/images/<device>/ (the task's image is
    url_prefix + that relative path)."""
    tasks = []
    for number, query in enumerate(queue.all(), 1):
        if only_open and query.label is not None:
            continue
        source = queue.image_path(query.device, query.query_id, query.media_type)
        relative = f"images/{query.device}/{source.name}"
        (out_dir / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, out_dir / relative)
        tasks.append(task_of(queue, query, url_prefix + relative, number))
    return tasks


@dataclass
class ImportCounts:
    """What an import did: answers decided, corrections of answered queries, votes recorded that decide nothing yet,
    and tasks passed over (unanswered, refused, or holding the answer the queue holds)."""

    decided: list[Decided]
    corrections: list[Correction]
    votes: int = 0
    unanswered: int = 0
    refused: int = 0
    unchanged: int = 0


@dataclass(frozen=True)
class TaskAnswer:
    """One annotated task's answer as the file holds it: the query it names, the choice and who chose it."""

    device: str
    query_id: str
    choice: str
    who: str


def expect(value: Any, kind: type, task: str, field: str, expected: str) -> Any:
    """`value` if it is a `kind` (a bool is no number); else a UsageError naming the task and the field."""
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise UsageError(f"{task}: {field} must be {expected}, got {wire.shown(value, 40)}")
    return value


def task_name(position: int, task: Any) -> str:
    """A task as an error names it: its place in the file and its Label Studio id."""
    ident = task.get("id") if isinstance(task, dict) else None
    return f"task {position}" + ("" if ident is None else f" (id {wire.shown(ident, 24)})")


def chosen(task: dict[str, Any], name: str) -> tuple[str, str] | None:
    """(choice, who) of a task's first annotation that was not cancelled and holds one choice, or None; UsageError
    for a wrong shape on the way."""
    annotations = expect(task.get("annotations") or [], list, name, "annotations", "a list")
    for number, annotation in enumerate(annotations):
        where = f"annotations[{number}]"
        expect(annotation, dict, name, where, "an object")
        if annotation.get("was_cancelled"):
            continue
        results = expect(annotation.get("result") or [], list, name, f"{where}.result", "a list")
        for place, result in enumerate(results):
            at = f"{where}.result[{place}]"
            value = expect(
                expect(result, dict, name, at, "an object").get("value", {}), dict, name, f"{at}.value", "an object"
            )
            choices = expect(value.get("choices", []), list, name, f"{at}.value.choices", "a list")
            if len(choices) == 1:
                choice = expect(choices[0], str, name, f"{at}.value.choices[0]", "a string")
                return choice, str(annotation.get("completed_by", "label-studio"))
    return None


def task_answer(position: int, task: Any) -> TaskAnswer | None:
    """A task's answer, None when it holds none; UsageError naming the task and field for a wrong shape."""
    name = task_name(position, task)
    expect(task, dict, name, "the task", "an object")
    data = expect(task.get("data"), dict, name, "data", "an object")
    answer = chosen(task, name)
    if answer is None:
        return None
    device = expect(data.get("device"), str, name, "data.device", "a string")
    query_id = expect(data.get("query_id"), str, name, "data.query_id", "a string")
    return TaskAnswer(device, query_id, *answer)


def import_tasks(queue: LabelQueue, tasks: list[Any]) -> ImportCounts:
    """Answers from Label Studio tasks (the ones an export wrote, annotated): each recorded by `label-studio:<who>`
    as the page records a person's word: a vote on an open query, and a correction of an answered one whose
    annotation was changed (sent to its device; the same answer again changes nothing). A file with a task of the
    wrong shape is refused whole (UsageError naming the task and the field) before any vote is recorded; an unknown
    query or a choice not in the spec is refused per task."""
    answers = [task_answer(position, task) for position, task in enumerate(tasks, 1)]
    counts = ImportCounts([], [])
    names = {name: number for number, name in enumerate(queue.class_names)} | {NONE_CHOICE: NONE_OF_THESE}
    for answer in answers:
        if answer is None:
            counts.unanswered += 1
            continue
        if answer.choice not in names:
            counts.refused += 1
            continue
        try:
            recorded = queue.record(
                answer.device, answer.query_id, names[answer.choice], f"label-studio:{answer.who}"[:64], change=True
            )
        except AnswerError:
            counts.refused += 1
            continue
        if recorded.decided is not None:
            counts.decided.append(recorded.decided)
        elif recorded.correction is not None:
            counts.corrections.append(recorded.correction)
        elif recorded.outcome is Outcome.VOTED:
            counts.votes += 1
        else:
            counts.unchanged += 1
    return counts
