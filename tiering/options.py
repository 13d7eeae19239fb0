"""Typed options: a pydantic model per tier (checked by its constructor with
:meth:`~Options.check`) and per config section, the one source of their options for the
registry, the TOML config, ``--set`` and docs/config.md. Values are checked strictly (an
int serves for a float, a size string for a :data:`Size`); :class:`Text` is converted to its
field's type first (``"none"`` or ``""`` unsets a field whose default is None). A bad value
raises :class:`InvalidArgumentError` (:class:`ConfigError` for a config) naming the option's
path, the value (never a :func:`secret`'s) and the reason."""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic_core import ErrorDetails, PydanticCustomError

from tiering.cli_args import parse_size
from tiering.errors import ConfigError, InvalidArgumentError


class Text(str):
    """A value written as text (a ``--set`` override): converted to its field's type."""

    def as_toml(self) -> object:
        """What the text reads as in TOML (``3``, ``true``, ``[1, 2]``), else the text."""
        try:
            return tomllib.loads(f"value = {self}")["value"]
        except tomllib.TOMLDecodeError:
            return str(self)


def _size(value: object) -> object:
    if not isinstance(value, str):
        return value
    if value.strip().isdecimal():  # "0" too, which parse_size refuses
        return int(value)
    try:
        return parse_size(value)
    except ValueError:
        raise PydanticCustomError("size", "expected a size such as 64GiB or 4096") from None


Size = Annotated[int, BeforeValidator(_size)]
"""Bytes: an int, or a size string as :func:`tiering.cli_args.parse_size` reads it."""

_SECRET: dict[str, Any] = {"secret": True}


def secret(default: Any = ...) -> Any:
    """A field whose value no error and no repr shows (a url that may hold a password,
    key material)."""
    return Field(default, repr=False, json_schema_extra=_SECRET)


class Options(BaseModel):
    """Frozen, typed options; unknown names are refused. :meth:`check` validates a mapping."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, strict=True, arbitrary_types_allowed=True
    )

    WHERE: ClassVar[str] = ""  # the path errors name the options under ("engine")
    ERROR: ClassVar[type[InvalidArgumentError]] = InvalidArgumentError
    UNKNOWN: ClassVar[str] = "{owner} takes no option {name!r}; it takes {fields}"

    @classmethod
    def check(
        cls,
        values: Mapping[str, object] | Options,
        *,
        where: str | None = None,
        owner: str | None = None,
        error: type[InvalidArgumentError] | None = None,
    ) -> Self:
        """``values`` validated as these options (an instance of them as it is). Raises
        ``error`` (by default :attr:`ERROR`) naming the option's path under ``where``
        (by default :attr:`WHERE`), its value and the reason; ``owner`` (by default the
        class's name) is who takes the options."""
        if isinstance(values, cls):
            return values
        where = cls.WHERE if where is None else where
        if not isinstance(values, Mapping):
            message = f"{where or 'options'}: expected a mapping, got {type(values).__name__}"
            raise _raise(error or cls.ERROR, where, message)
        return cls._validated(values, cls.model_validate, where, owner, error)

    @classmethod
    def _validated(
        cls,
        values: Mapping[str, object],
        build: Callable[[dict[str, object]], Any],
        where: str,
        owner: str | None,
        error: type[InvalidArgumentError] | None,
    ) -> Any:
        """``build(values)``, each :class:`Text` value converted first; pydantic's errors
        raised as :meth:`check` says, unchained (they quote values, which may be secret)."""
        converted, name = dict(values), ""
        try:
            for name, value in values.items():
                if isinstance(value, Text):
                    converted[name] = cls._from_text(name, value)
        except ValidationError as exc:  # one field's own errors: named after it
            errors = [{**e, "loc": (name, *e["loc"])} for e in exc.errors()]
        else:
            try:
                return build(converted)
            except ValidationError as exc:
                errors = exc.errors()
        raise cls._error(errors, values, where, owner, error or cls.ERROR)  # type: ignore[arg-type]

    @classmethod
    def _from_text(cls, name: str, text: Text) -> object:
        """``text`` as field ``name``'s type (lax; None for "none" or "" where the default is
        None); an unknown name's text as it is, for the model to refuse."""
        field = cls.model_fields.get(name)
        if field is None:
            return str(text)
        if field.default is None and text.strip().lower() in ("none", ""):
            return None
        # The type, constraints and validators only: pydantic warns of the field's own
        # attributes (repr, default, ...) outside a model.
        annotation = field.annotation
        if field.metadata:
            annotation = Annotated[(annotation, *field.metadata)]  # type: ignore[assignment]
        adapter = TypeAdapter(annotation, config=ConfigDict(arbitrary_types_allowed=True))
        return adapter.validate_strings(str(text))

    @classmethod
    def _error(
        cls,
        errors: list[ErrorDetails],
        values: Mapping[str, object],
        where: str,
        owner: str | None,
        error: type[InvalidArgumentError],
    ) -> InvalidArgumentError:
        # The first field's error: an unknown name first (a misspelt option also leaves
        # the one meant missing), a missing one last (a bad value given says more).
        order = {"extra_forbidden": 0, "missing": 2}
        first = min(errors, key=lambda e: order.get(e["type"], 1))
        name = str(first["loc"][0]) if first["loc"] else ""
        reasons = [_reason(e) for e in errors if (e["loc"][:1] == first["loc"][:1])]
        if not name:  # a check across fields: its message starts with a field's name
            return _raise(error, where, f"{where}.{reasons[0]}" if where else reasons[0])
        path = f"{where}.{name}" if where else name
        owner = owner or cls.__name__
        if first["type"] == "missing":
            return _raise(error, path, f"{path}: {owner} needs this option; it is missing")
        if first["type"] == "extra_forbidden":
            fields = ", ".join(cls.model_fields)
            reasons = [cls.UNKNOWN.format(owner=owner, name=name, fields=fields, where=where)]
        why = "; or ".join(dict.fromkeys(reasons))
        field = cls.model_fields.get(name)
        if field is not None and field.json_schema_extra == _SECRET:
            return _raise(error, path, f"{path}: {why} (its value is not shown)")
        value = values[name] if name in values else first["input"]
        return _raise(error, path, f"{path} = {shown(value)}: {why}")


def _reason(error: ErrorDetails) -> str:
    if error["type"] == "value_error":
        return str(error.get("ctx", {}).get("error", error["msg"]))
    return error["msg"]


def _raise(error: type[InvalidArgumentError], path: str, message: str) -> InvalidArgumentError:
    if issubclass(error, ConfigError):
        return error(message, field=path)
    return error(message)


def shown(value: object) -> str:
    """``value`` as an error message shows it: its repr (a Text's as a str), cut at 80."""
    text = repr(str(value) if isinstance(value, Text) else value)
    return text if len(text) <= 80 else text[:77] + "..."


PositiveInt = Annotated[int, Field(gt=0)]
Count = Annotated[int, Field(ge=0)]
Bytes = Annotated[Size, Field(gt=0)]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]  # positive, finite
SecondsOrZero = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class ActorOptions(Options):
    """What every :class:`~tiering.tiers.actor.TierActor` takes: the inbox's size, the jobs
    run at once and the threads of its blocking byte work (each a positive int); which
    blocks the engine writes to it (``admission``: ``all``, ``seen-twice`` or
    ``adaptive``, :mod:`tiering.core.admission`) and how many bytes a second at most
    (``write_budget``, None: unbounded; :mod:`tiering.core.write_budget`)."""

    inbox_size: PositiveInt = 64
    max_inflight: PositiveInt = 4
    io_threads: PositiveInt = 4
    admission: Literal["all", "seen-twice", "adaptive"] = "all"
    write_budget: Bytes | None = None

    def actor_options(self) -> dict[str, Any]:
        """These as :class:`~tiering.tiers.actor.TierActor`'s keyword arguments."""
        return {name: getattr(self, name) for name in ActorOptions.model_fields}
