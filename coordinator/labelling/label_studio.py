# The queue as Label Studio JSON tasks (image choices: the model's guess as a prediction, answers as annotations)
# and Label Studio's annotations read back as answers.
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.labelling.queue import AnswerError, Decided, LabelQueue, QueuedQuery
from protocol.label_messages import NONE_OF_THESE

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
    if query.guess >= 0:
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
    """What an import did: answers decided, votes recorded that decide nothing yet, and tasks passed over."""

    decided: list[Decided]
    votes: int = 0
    unanswered: int = 0
    refused: int = 0


def chosen(task: dict[str, Any]) -> tuple[str, str] | None:
    """(choice, who) of a task's first annotation that was not cancelled, or None."""
    for annotation in task.get("annotations") or []:
        if not isinstance(annotation, dict) or annotation.get("was_cancelled"):
            continue
        for result in annotation.get("result") or []:
            choices = result.get("value", {}).get("choices") if isinstance(result, dict) else None
            if isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], str):
                return choices[0], str(annotation.get("completed_by", "label-studio"))
    return None


def import_tasks(queue: LabelQueue, tasks: list[Any]) -> ImportCounts:
    """Answers from Label Studio tasks (the ones an export wrote, annotated): each a person's vote in the queue,
    by `label-studio:<who>`; an unknown query, a choice not in the spec, or a query answered already is refused."""
    counts = ImportCounts([])
    names = {name: number for number, name in enumerate(queue.class_names)} | {NONE_CHOICE: NONE_OF_THESE}
    for task in tasks:
        data = task.get("data") if isinstance(task, dict) else None
        answer = chosen(task) if isinstance(data, dict) else None
        if answer is None or not isinstance(data, dict):
            counts.unanswered += 1
            continue
        device, query_id, (choice, who) = data.get("device"), data.get("query_id"), answer
        if not isinstance(device, str) or not isinstance(query_id, str) or choice not in names:
            counts.refused += 1
            continue
        try:
            decided = queue.answer(device, query_id, names[choice], f"label-studio:{who}"[:64])
        except AnswerError:
            counts.refused += 1
            continue
        if decided is None:
            counts.votes += 1
        else:
            counts.decided.append(decided)
    return counts
