"""``docs/config.md``, the config reference, generated from the models of this package.

Every key is listed with its full dotted name, the values it accepts, its default and its
``Field(description=...)``, section by section. Regenerate after changing a model::

    python -m linnaeus_accel.config_reference > docs/config.md

(``tests/test_config_reference.py`` fails while the file is stale or a key has no description.)
"""

from __future__ import annotations

import inspect
import re
import sys
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import AfterValidator, AliasChoices, BaseModel
from pydantic.fields import FieldInfo

from .config.base import RULE_NAMES, timed_parameters
from .config.root import Config

COMMAND = "python -m linnaeus_accel.config_reference > docs/config.md"


@dataclass(frozen=True)
class Key:
    """One leaf key: a value, not a section."""

    path: str  # full dotted name, list items as <i>
    field: FieldInfo

    @property
    def description(self) -> str:
        return (self.field.description or "").strip()


@dataclass(frozen=True)
class SectionDoc:
    path: str
    model: type[BaseModel]
    about: str  # the section's docstring and its field's description
    keys: tuple[Key, ...]


def sections(model: type[BaseModel] = Config, path: str = "", about: str = "") -> Iterator[SectionDoc]:
    """Every section, parents before children, each with its leaf keys."""
    keys: list[Key] = []
    children: list[tuple[str, type[BaseModel], str]] = []
    for name, field in model.model_fields.items():
        dotted = f"{path}.{name}" if path else name
        sub = _section_model(field.annotation)
        if sub is not None and get_origin(field.annotation) is not list:
            children.append((dotted, sub, field.description or ""))
            continue
        keys.append(Key(dotted, field))
        if sub is not None:  # a list of sections: its items are documented as <KEY>.<i>
            children.append((f"{dotted}.<i>", sub, ""))
    if path:
        yield SectionDoc(path, model, _join(about, _docstring(model)), tuple(keys))
    for child_path, child, child_about in children:
        yield from sections(child, child_path, child_about)


def all_keys() -> list[Key]:
    return [key for section in sections() for key in section.keys]


def unit_families(model: type[BaseModel]) -> list[list[str]]:
    """Groups of fields that are one timed parameter in several units (at most one may be set)."""
    return [list(spec.keys.values()) for spec in timed_parameters(model).values()]


def type_text(annotation: Any, metadata: Sequence[Any] = ()) -> str:
    """What a field accepts, in words: 'integer >= 1, or null', '`min` | `max`'."""
    rules = [RULE_NAMES[m.func] for m in metadata if isinstance(m, AfterValidator) and m.func in RULE_NAMES]
    origin = get_origin(annotation)
    if origin is Annotated:
        base, *extra = get_args(annotation)
        return type_text(base, [*extra, *metadata])
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        text = " or ".join(type_text(a) for a in args)
        return f"{text}, or null" if len(args) < len(get_args(annotation)) else text
    if origin is Literal:
        return " | ".join(f"`{v}`" for v in get_args(annotation))
    if origin is list:
        (item,) = get_args(annotation)
        sub = _section_model(item)
        return "list of sections (below)" if sub is not None else f"list of {_plural(type_text(item))}"
    if origin is dict:
        return "mapping"
    if rules:
        # The first rule names the kind and range ('integer >= 1'); later ones narrow it ('at most 64').
        return ", ".join(rules)
    names = {bool: "boolean", int: "integer", float: "number", str: "string"}
    return names.get(annotation, "any value") if isinstance(annotation, type) else "any value"


def _plural(text: str) -> str:
    """'string' -> 'strings', 'list of strings' -> 'lists of strings', 'number >= 0' -> 'numbers >= 0'."""
    head, sep, rest = text.partition(" ")
    if head in ("string", "integer", "number", "boolean", "list", "probability", "mapping"):
        return ("probabilities" if head == "probability" else head + "s") + sep + rest
    return f"values ({text})"


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "(required)"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return ""
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("...").strip()


def render() -> str:
    docs = list(sections())
    top = [s for s in docs if "." not in s.path]
    out = [
        "# Configuration reference",
        "",
        "Generated from the pydantic models in `linnaeus_accel/config/` by",
        "",
        f"    {COMMAND}",
        "",
        "Do not edit it by hand: change a key's `Field(description=...)` and regenerate",
        "(`tests/test_config_reference.py` fails while this file is stale).",
        "",
        INTRO,
        "",
        "Sections: " + ", ".join(f"[{s.path}](#{_anchor(s.path)})" for s in top) + ".",
    ]
    for section in docs:
        level = "##" if "." not in section.path else "###"
        out += ["", f"{level} {_text(section.path)}"]
        if section.about:
            out += ["", _text(section.about)]
        for family in unit_families(section.model):
            names = ", ".join(f"`{n}`" for n in family)
            out += ["", f"One unit: set at most one of {names}."]
        if not section.keys:
            continue
        out += ["", "| key | accepts | default | description |", "|---|---|---|---|"]
        for key in section.keys:
            out.append(_row(key))
    out += _builtin_callbacks()
    return "\n".join(out) + "\n"


def _builtin_callbacks() -> list[str]:
    """The OPTIONS of each built-in callback of ``CALLBACKS``."""
    from .config.callbacks import BUILTIN_OPTIONS

    out = [
        "",
        "## Built-in callbacks",
        "",
        "`CALLBACKS: [{NAME: <name>, OPTIONS: {...}, INTERVAL_*: ...}]`; what each does is in the",
        "docstring of `linnaeus_accel/callbacks/<name>.py`.",
    ]
    for name, model in BUILTIN_OPTIONS.items():
        out += ["", f"### {name}", "", "| option | type | default | description |", "|---|---|---|---|"]
        for field_name, field in model.model_fields.items():
            option = field.alias or field_name
            annotation = field.annotation
            kind = annotation.__name__ if isinstance(annotation, type) else str(annotation)
            kind = kind.replace("typing.", "").replace(" | ", " or ")
            out.append(
                f"| `{option}` | {_text(kind)} | `{default_text(field)}` | {_text(field.description or '')} |"
            )
    return out


INTRO = """\
A config is a YAML file of UPPERCASE sections; `BASE: [file.yaml, ...]` merges other files
underneath it (paths relative to the file; later files and keys win). Any key can be set from the
command line with `--opts KEY VALUE` (dotted key, e.g. `--opts SCHEDULE.VALIDATION.INTERVAL_EPOCHS 2`):
VALUE is read as YAML, exactly as it would be after `KEY:` in a file, so `null` means there what
it means in a file. A misspelt key, a value of the wrong type (`true` for a count, `"5"` for a
number) and every broken rule are reported together, each naming its dotted key.

## Value rules

- **Steps** are optimizer (global) steps: one per optimizer update, whatever the number of
  processes or the gradient accumulation. `T` is the run's total steps.
- **One unit per timed parameter**: a duration, position or interval is written in one of the units
  `<NAME>_STEPS` (global steps), `<NAME>_FRACTION` (of `T`) or `<NAME>_EPOCHS` (of the optimizer
  steps per epoch); setting two units of one parameter is an error naming both. Unset is `null`,
  never `0` or a value in another unit. Each section below names its groups of units.
- **Fractions** `f > 0` resolve to `max(1, round(f * T))` steps (half up, on the value as
  written); `0` disables an interval and means step 0 for a position. **Epochs** resolve to
  `round(e * optimizer_steps_per_epoch)` and may be fractional for durations and positions.
- **Intervals** (`INTERVAL_EPOCHS` / `INTERVAL_STEPS` / `INTERVAL_FRACTION`) fire at epoch
  boundaries, numbered by completed epochs 1, 2, ...: `INTERVAL_EPOCHS: N` fires when the epoch
  is a multiple of `N`; `INTERVAL_STEPS: S` (and a fraction, resolved to `S` steps) fires at the
  first boundary at or after each multiple of `S` global steps; with `MID_EPOCH` (validation,
  checkpoints) at each multiple itself, inside an epoch. A stream without `__len__` has epochs of
  unknown length: its `*_EPOCHS` keys are errors, and the run's length is `TRAIN.STEPS` or
  `TRAIN.TARGET_TOKENS`.
- **OPTIONS follow their NAME**: `DATA.DATASET.OPTIONS` and `MODEL.OPTIONS` belong to the dataset
  or model named beside them; a config (through `BASE`) or `--opts` that names another one starts
  its OPTIONS afresh instead of merging them.
- **Off is null**: a count that can be switched off (an interval, a patience, a cut-off) accepts
  an integer >= 1 or `null`; `0` is an error rather than a second spelling of off.
- **null** is accepted only where the "accepts" column says so, with the meaning the description
  gives (off, automatic, or the value of another key); anywhere else it is an error that names the
  default. To get a key's default back, write the default shown here."""


def _row(key: Key) -> str:
    description = key.description
    alias = key.field.validation_alias
    if isinstance(alias, AliasChoices):
        others = [str(c) for c in alias.choices if c != key.path.rsplit(".", 1)[-1]]
        unsaid = [o for o in others if o not in description]
        if unsaid:
            description += f" Also spelled {', '.join(unsaid)}."
    default = default_text(key.field)
    cells = [
        f"`{key.path}`",
        type_text(key.field.annotation, key.field.metadata),
        f"`{default}`" if default else "",
        description,
    ]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def _section_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _section_model(arg)
        if found is not None:
            return found
    return None


def _docstring(model: type[BaseModel]) -> str:
    # Only the model's own docstring (not an inherited one), without its pointers to the sections
    # of docs/ that explain it to a reader of the code (the reference links semantics.md itself).
    doc = model.__dict__.get("__doc__") or ""
    text = " ".join(inspect.cleandoc(doc).split())
    return re.sub(r"\s*\(docs/\w+\.md §[^)]*\)", "", text).replace("``", "`")


def _join(*parts: str) -> str:
    return " ".join(p.strip() for p in parts if p.strip())


def _cell(text: str) -> str:
    # A table cell ends at a pipe: escape those inside the text ('cosine | linear').
    return _text(text).replace("|", "\\|").replace("\n", " ")


def _text(text: str) -> str:
    """Markdown for plain text: '<BASE_DIR>' outside code spans would be read as an HTML tag."""
    parts = text.split("`")
    parts[::2] = [re.sub(r"<(?=[A-Za-z/!?])", "&lt;", p) for p in parts[::2]]
    return "`".join(parts)


def _anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than - and _ dropped."""
    return re.sub(r"[^a-z0-9_\- ]", "", title.lower()).replace(" ", "-")


def main(argv: Sequence[str] | None = None) -> int:
    """Print the reference; with a path argument, write it there instead."""
    args = list(sys.argv[1:] if argv is None else argv)
    text = render()
    if args:
        with open(args[0], "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
