"""The learners' ``Diagnosis`` objects, from RLlib's result to MLflow tags, artifacts and console lines.

A learner logs one ``Diagnosis`` JSON per module and non-finite event under
``result["learners"][module][RESULT_KEY]`` (RLlib's ``item_series``: one per learner,
never averaged).  ``gradmon-ray train`` and the MLflow callback turn them into the
``gradmon.diagnosis`` tag (JSON, one per module: the one whose re-run reproduced the event, with
rows, first); the sink writes each into its artifact ``diagnosis/iter_<n>_<module>.json`` when it
writes the tag (live and from a spill file alike), so nothing is lost to an outage.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from gradmon_ray import metric_names as mn
from gradmon_ray import metric_parsing as mp
from gradmon_ray.telemetry.blame import RESULT_KEY, Diagnosis, skipped_text

logger = logging.getLogger(__name__)

DIAGNOSIS_DIR = "diagnosis"
DIAGNOSIS_ARTIFACT = DIAGNOSIS_DIR + "/iter_{iteration}_{module}.json"
"""One event's artifact: the ``Diagnosis`` of module ``module`` at iteration ``iteration``."""
SHARED_COSINES_KEY = "gradmon_shared_cosines"
"""The learner-wide key (``result["learners"]["__all_modules__"]``) of every pair's shared-gradient cosine (JSON)."""
MAX_TAG_CHARS = 5000
"""The longest tag value every MLflow store keeps (5000 before MLflow 2.x raised it to 8000)."""


def diagnoses_in(result: Mapping[str, Any]) -> list[Diagnosis]:
    """One ``Diagnosis`` per module with an event this iteration, the most telling learner's."""
    learners = result.get("learners")
    if not isinstance(learners, Mapping):
        return []
    found = []
    for values in learners.values():
        items = values.get(RESULT_KEY) if isinstance(values, Mapping) else None
        if isinstance(items, str):
            items = [items]
        parsed = []
        for text in items or ():
            try:
                parsed.append(Diagnosis.from_json(text))
            except (TypeError, ValueError, KeyError):
                logger.warning("gradmon: an unreadable diagnosis was left out: %.200s", text)
        if parsed:
            # A learner whose own data reproduced the event names its rows; others saw only the average.
            found.append(max(parsed, key=lambda d: (bool(d.reproduced), (d.rows or {}).get("count", 0), -d.rank)))
    return found


def shared_cosine_tags(result: Mapping[str, Any]) -> dict[str, str]:
    """``gradmon.shared_cosines``: the pairs' cosines of this iteration (rank 0's: the weights are the same)."""
    learners = result.get("learners")
    wide = learners.get("__all_modules__") if isinstance(learners, Mapping) else None
    items = wide.get(SHARED_COSINES_KEY) if isinstance(wide, Mapping) else None
    if isinstance(items, str):
        items = [items]
    return {mn.TAG_SHARED_COSINES: items[0]} if items else {}


def diagnosis_tags(diagnoses: list[Diagnosis], metrics: Mapping[str, float], iteration: int) -> dict[str, str]:
    """``gradmon.diagnosis`` (this iteration's diagnoses as a JSON list) and ``gradmon.skipped``."""
    tags = {}
    if diagnoses:
        tags[mn.TAG_DIAGNOSIS] = _fitting_json(diagnoses)
    skipped = skipped_summary(metrics)
    if skipped:
        tags[mn.TAG_SKIPPED] = f"iteration {iteration}: {skipped}"
    return tags


def _fitting_json(diagnoses: list[Diagnosis]) -> str:
    """The JSON list, dropping each diagnosis's re-run details, then whole diagnoses, until it fits a tag."""
    items = [json.loads(d.to_json()) for d in diagnoses]
    text = json.dumps(items, sort_keys=True)
    for item in items:
        if len(text) <= MAX_TAG_CHARS:
            break
        item["rerun"] = {}
        text = json.dumps(items, sort_keys=True)
    while len(text) > MAX_TAG_CHARS and len(items) > 1:
        items.pop()
        text = json.dumps(items, sort_keys=True)
    return text


def diagnoses_from_tag(value: str | None) -> list[Diagnosis]:
    """The ``gradmon.diagnosis`` tag read back (an empty list for none or an unreadable one)."""
    if not value:
        return []
    try:
        return [Diagnosis.from_json(json.dumps(item)) for item in json.loads(value)]
    except (TypeError, ValueError, KeyError):
        return []


def diagnosis_artifacts(tags: Mapping[str, str]) -> dict[str, str]:
    """Artifact path -> pretty JSON of each diagnosis in ``tags`` (none without the tag)."""
    out = {}
    for diagnosis in diagnoses_from_tag(tags.get(mn.TAG_DIAGNOSIS)):
        path = DIAGNOSIS_ARTIFACT.format(iteration=diagnosis.iteration, module=diagnosis.module)
        out[path] = json.dumps(json.loads(diagnosis.to_json()), indent=2, sort_keys=True) + "\n"
    return out


def log_diagnosis_artifacts(client: Any, run_id: str, tags: Mapping[str, str]) -> None:
    """Write the artifacts of ``tags``' diagnoses (``MlflowClient.log_text``; the same again on a retry)."""
    for path, text in diagnosis_artifacts(tags).items():
        client.log_text(run_id, text, path)


def load_diagnoses(client: Any, run_id: str) -> list[Diagnosis]:
    """Every event's ``Diagnosis`` of a run, from its ``diagnosis/`` artifacts, by iteration and module."""
    import tempfile

    found = []
    artifacts = [a for a in client.list_artifacts(run_id, DIAGNOSIS_DIR) if a.path.endswith(".json")]
    with tempfile.TemporaryDirectory(prefix="gradmon-diagnosis-") as directory:
        for artifact in artifacts:
            local = client.download_artifacts(run_id, artifact.path, directory)
            try:
                with open(local) as handle:
                    found.append(Diagnosis.from_json(handle.read()))
            except (OSError, TypeError, ValueError, KeyError):
                logger.warning("gradmon: unreadable diagnosis artifact %s left out", artifact.path)
    return sorted(found, key=lambda d: (d.iteration, d.module))


def skipped_summary(metrics: Mapping[str, float]) -> str | None:
    """``skipped k/n`` (``: did not train`` when every minibatch was) over the iteration's modules."""
    skipped = minibatches = 0.0
    for key, value in metrics.items():
        parsed = mp.parse(key)
        if parsed is None:
            continue
        if parsed.template == mn.SKIPPED_UPDATES:
            skipped += value
        elif parsed.template == mn.MINIBATCH_UPDATES:
            minibatches += value
    return skipped_text(int(skipped), int(minibatches)) if skipped > 0 else None
