"""Served models as values: the names an endpoint serves, their checks, and the OpenAI list shape.

Pure and leaf: discovery (EDS metadata ``models``, the pod annotation), the engine scrape (vLLM's
``GET /v1/models``), the registry and the request parser all speak it. An endpoint serves either every
model (nothing declared nor discovered: the configurations from before routing by model) or the
names of a :class:`ServedModels` set. A LoRA adapter is a model name like any other, with its base
model as ``parent`` (vLLM lists adapters so): routing treats it as one more name, and a later
adapter-aware preference can read the parent without another shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

MAX_MODEL_NAME_CHARS = 512
"""The longest model name accepted, in characters: a Hugging Face id (``org/name``, 96 + 96) or an
adapter path with room to spare; a 10 kB name is a client's mistake (or worse), refused at once."""
MAX_MODELS_PER_ENDPOINT = 256
"""The most model names one endpoint may serve (base models and adapters together): what bounds the
``model`` label of the per-endpoint metrics, with the endpoint count."""


class ModelNameError(ValueError):
    """A model name that cannot be routed: the message says why."""


def check_model_name(value: object, where: str) -> str:
    """``value`` if it is a routable model name; raise :class:`ModelNameError` naming ``where``.

    A name is a string of 1 to :data:`MAX_MODEL_NAME_CHARS` characters, not only white space."""
    if not isinstance(value, str):
        raise ModelNameError(f"{where} must be a string")
    if not value.strip():
        raise ModelNameError(f"{where} must not be empty")
    if len(value) > MAX_MODEL_NAME_CHARS:
        raise ModelNameError(
            f"{where} is {len(value)} characters long; at most {MAX_MODEL_NAME_CHARS} are allowed"
        )
    return value


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model an endpoint serves.

    ``name`` as requests name it, ``parent`` the base model of an adapter (``None``: a base model, or not
    known)."""

    name: str
    parent: str | None = None


def check_models(values: Iterable[object], where: str) -> tuple[str, ...]:
    """The declared names ``values`` (EDS metadata, a pod annotation), each checked, duplicates once.

    Raises :class:`ModelNameError` for a bad name, for none at all (an empty list would serve nothing:
    leave the key out to serve every model) or for more than :data:`MAX_MODELS_PER_ENDPOINT`."""
    names = tuple(dict.fromkeys(check_model_name(v, f"{where} entries") for v in values))
    if not names:
        raise ModelNameError(f"{where} must list at least one model (leave it out to serve every model)")
    if len(names) > MAX_MODELS_PER_ENDPOINT:
        raise ModelNameError(
            f"{where} lists {len(names)} models; at most {MAX_MODELS_PER_ENDPOINT} are allowed"
        )
    return names


def parse_model_list(raw: bytes) -> tuple[ServedModel, ...]:
    """The models of an OpenAI ``GET /v1/models`` answer.

    vLLM lists the base model, then its adapters with their ``parent``. Raises :class:`ModelNameError`
    when ``raw`` is not such an answer, or names none."""
    try:
        document = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ModelNameError(f"not JSON: {exc}") from None
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, list):
        raise ModelNameError("not an OpenAI model list (no 'data' list)")
    models: dict[str, ServedModel] = {}
    for index, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise ModelNameError(f"data[{index}] is not an object")
        name = check_model_name(entry.get("id"), f"data[{index}].id")
        parent = entry.get("parent")
        parent = None if parent is None else check_model_name(parent, f"data[{index}].parent")
        models.setdefault(name, ServedModel(name, parent))
    if not models:
        raise ModelNameError("the model list is empty")
    if len(models) > MAX_MODELS_PER_ENDPOINT:
        raise ModelNameError(f"{len(models)} models listed; at most {MAX_MODELS_PER_ENDPOINT} are kept")
    return tuple(models.values())


def model_list_body(models: Iterable[ServedModel]) -> bytes:
    """The OpenAI ``GET /v1/models`` answer listing ``models`` (sorted by name), as UTF-8 JSON bytes."""
    data = [
        {"id": m.name, "object": "model", "created": 0, "owned_by": "pd-extproc", "parent": m.parent}
        for m in sorted(models, key=lambda m: m.name)
    ]
    return json.dumps({"object": "list", "data": data}, ensure_ascii=False).encode()
