"""The field types of the JSON state a checkpoint holds, for the pydantic models that each stateful
part keeps beside its ``state_dict`` (``TrainingProgress``, ``EarlyStopping``, ...), and the one-line
message of a state that breaks its model. Plain pydantic (layer 0): the lowest part may use them.

Strict (``StateModel``): a step count is an int, never ``true`` nor ``24.0`` nor ``"24"``; a number is an int or a
float, never a bool (NaN and infinities are numbers: a diverged loss is worth keeping). Each type's
``description`` is the rule a rejected checkpoint's message states: ``progress.epoch must be an
integer >= 0, got -1`` (``error_line``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, get_args

from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails


class StateModel(BaseModel):
    """The format of one part's state. Keys it does not know are ignored (a newer version's), so
    that a checkpoint's JSON keeps loading; those it knows must be what this version writes."""

    model_config = ConfigDict(strict=True, extra="ignore", use_enum_values=True)

    def as_data(self) -> dict[str, Any]:
        """The state as plain JSON data: what ``state_dict`` returns (NaN stays a float)."""
        return self.model_dump()


def absent() -> Any:
    """The default of a key that older checkpoints lack but that, when present, must not be null:
    what its absence means is the loader's to say (it never reaches a ``state_dict``)."""
    return Field(default=None)


Int = Annotated[int, Field(description="must be an integer")]
OptInt = Annotated[Int | None, Field(description="must be an integer or null")]
Count = Annotated[int, Field(ge=0, description="must be an integer >= 0")]
OptCount = Annotated[Count | None, Field(description="must be an integer >= 0 or null")]
Positive = Annotated[int, Field(ge=1, description="must be an integer >= 1")]
OptPositive = Annotated[Positive | None, Field(description="must be an integer >= 1 or null")]
# int | float keeps an int an int (the JSON written stays the same); a bool is neither, strictly.
Number = Annotated[int | float, Field(description="must be a number")]
OptNumber = Annotated[Number | None, Field(description="must be a number or null")]
OptNumbers = Annotated[list[Number] | None, Field(description="must be a list of numbers or null")]
Ints = Annotated[list[Int], Field(description="must be a list of integers")]
Flag = Annotated[bool, Field(description="must be true or false")]
Text = Annotated[str, Field(description="must be a string")]
OptText = Annotated[Text | None, Field(description="must be a string or null")]
OptObject = Annotated[dict[str, Any] | None, Field(description="must be an object or null")]


# -- the one-line message of a state that breaks its format ---------------------------------------


def schema_problem(model: type[BaseModel], data: Any, where: str) -> str | None:
    """None if ``data`` is what ``model`` describes, else its first problem in one line, named by
    the key of the part and of the field in it: ``trainer_state.json: progress.epoch must be an
    integer >= 0, got -1``."""
    try:
        model.model_validate(data)
    except ValidationError as exc:
        return error_line(exc.errors()[0], model, data, where)
    return None


def error_line(error: ErrorDetails, model: type[BaseModel], data: Any, where: str) -> str:
    """One line for pydantic's ``error`` in ``data`` (validated as ``model``) in ``where`` (a file):
    the part and its field (a deeper problem is named at the field, whose rule covers it), the
    field's rule (its ``description``), and the value found (of a mapping, the entry at fault)."""
    loc, names, value = error["loc"], [], data
    fields: dict[str, FieldInfo] | None = model.model_fields
    field: FieldInfo | None = None
    for key in loc[:2]:
        if fields is None or not isinstance(key, str) or key not in fields:
            break
        field, inner = fields[key], model_in(fields[key])
        names.append(key)
        value = value.get(key) if isinstance(value, dict) else None
        fields = inner.model_fields if inner is not None and not issubclass(inner, RootModel) else None
    what = ".".join(names)
    if error["type"] == "missing" and len(names) == len(loc):
        return f"{where}: {what} is missing"
    if field is None or field.description is None:
        return f"{where}: {what or 'the state'}: {error['msg']}"
    if isinstance(value, dict) and fields is None and len(loc) > len(names):
        value = {loc[len(names)]: value.get(str(loc[len(names)]))}
    return f"{where}: {what} {field.description}, got {shown(value)}"


def shown(value: Any) -> str:
    """A value as a message shows it: its JSON, cut at 60 characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def model_in(field: FieldInfo) -> type[BaseModel] | None:
    """The model a field holds (``ProgressState`` of ``ProgressState | None``), if any."""
    for kind in (field.annotation, *get_args(field.annotation)):
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            return kind
    return None
