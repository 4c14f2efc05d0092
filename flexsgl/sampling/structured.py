"""StructuredOutputsParams: the constraint a request's output must follow, as vLLM names it.

Exactly one of: `json` (a JSON schema, as a dict or its JSON text), `regex`, `choice` (the output
is one of these strings), `grammar` (EBNF in xgrammar's GBNF dialect) or `json_object` (any JSON
object). Checked for type here; whether the schema, regex or grammar itself is valid is checked
when it is parsed (sampling/grammar.py), before the request runs.

check_json_schema refuses a JSON schema that uses a keyword xgrammar (0.2.9) accepts but does not
enforce, rather than let the output follow it loosely (vLLM's has_xgrammar_unsupported_json_features,
checked against xgrammar's own outputs): contains, minContains, maxContains, uniqueItems (true),
dependentRequired, dependentSchemas, dependencies, if/then/else, not, allOf of several schemas,
multipleOf outside `type: integer`, and minLength or maxLength beside a pattern or a format of
XGRAMMAR_FORMATS. Other formats (pydantic's `password`, `binary`, ...) constrain nothing, as a
JSON Schema validator treats a format by default: the string is any string. `oneOf` is enforced as
`anyOf` (as in vLLM): an output matches at least one of its schemas, and may match several where
they overlap; disjoint ones (pydantic's discriminated unions, branches told apart by a `const`)
are exact.
"""

from __future__ import annotations

import json as jsonlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from functools import partial

from flexsgl.errors import SamplingParamsError, short_repr

UNENFORCED_KEYWORDS = ("contains", "minContains", "maxContains", "dependentRequired", "dependentSchemas",
                      "dependencies", "if", "then", "else", "not")
XGRAMMAR_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                              "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
# Where a schema holds subschemas: one, a list of them, or a map of names to them.
SUBSCHEMA = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties",
             "propertyNames", "contains", "not", "if", "then", "else")
SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
MAX_CHOICES = 1024
MAX_SPEC_CHARS = 1_000_000  # a schema, regex or grammar longer than this is refused


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | None = None  # a JSON schema's text (a dict given here is dumped)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        put = partial(object.__setattr__, self)
        if self.json is not None:
            if isinstance(self.json, bool) or not isinstance(self.json, (str, Mapping)):
                raise SamplingParamsError(f"structured_outputs json must be a JSON schema (an object or its JSON "
                                          f"text), got {short_repr(self.json)}.")
            if isinstance(self.json, Mapping):
                try:
                    put("json", jsonlib.dumps(self.json))
                except (TypeError, ValueError) as e:
                    raise SamplingParamsError(f"structured_outputs json is not JSON ({e}).") from None
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SamplingParamsError(f"structured_outputs {name} must be a non-empty string, "
                                          f"got {short_repr(value)}.")
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes, Mapping)) or not isinstance(self.choice, Iterable):
                raise SamplingParamsError(f"structured_outputs choice must be a list of strings, "
                                          f"got {short_repr(self.choice)}.")
            choice = tuple(self.choice)
            if not choice or len(choice) > MAX_CHOICES or not all(isinstance(c, str) and c for c in choice):
                raise SamplingParamsError(f"structured_outputs choice must hold 1 to {MAX_CHOICES} non-empty "
                                          f"strings, got {short_repr(self.choice)}.")
            put("choice", choice)
        if not isinstance(self.json_object, bool):
            raise SamplingParamsError(f"structured_outputs json_object must be True or False, "
                                      f"got {short_repr(self.json_object)}.")
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamsError("structured_outputs takes exactly one of json, regex, choice, grammar and "
                                      f"json_object, got {', '.join(given) if given else 'none'}.")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise SamplingParamsError(f"structured_outputs {self.kind} has {len(self.spec)} characters; at most "
                                      f"{MAX_SPEC_CHARS} are allowed.")

    @property
    def kind(self) -> str:
        """Which constraint: json, regex, choice, grammar or json_object."""
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint's text (choices joined by newlines), for messages and sizes."""
        value = getattr(self, self.kind)
        return "\n".join(value) if self.kind == "choice" else "" if value is True else value

    @classmethod
    def of(cls, value) -> "StructuredOutputsParams | None":
        """`value` (None, a StructuredOutputsParams or a mapping of its fields) as one, checked."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise SamplingParamsError(f"structured_outputs must be a StructuredOutputsParams or a mapping of its "
                                      f"fields, got {short_repr(value)}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise SamplingParamsError(f"structured_outputs has no field {unknown[0]!r}; it takes "
                                      f"{', '.join(sorted(known))}.")
        return cls(**value)


def check_json_schema(schema: Mapping | str, where: str) -> None:
    """Raise SamplingParamsError if `schema` (or its JSON text) uses a keyword xgrammar cannot
    enforce, naming it and where it is; `where` names the schema in the message."""
    if isinstance(schema, str):
        try:
            schema = jsonlib.loads(schema)
        except ValueError:
            return  # parsing it says what is wrong
    found = unenforced_keyword(schema)
    if found is not None:
        keyword, path = found
        raise SamplingParamsError(f"{where} uses {keyword}{' at ' + path if path else ''}, which structured outputs "
                                  "(xgrammar) cannot enforce; remove it.")


def unenforced_keyword(schema) -> tuple[str, str] | None:
    """(the first keyword of a JSON schema that xgrammar would ignore, its schema's dotted path, "" at
    the root), or None."""
    stack = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, Mapping):
            continue
        keyword = _unenforced_here(node)
        if keyword is not None:
            return keyword, path
        stack += reversed(list(_subschemas(node, path)))
    return None


def _unenforced_here(schema: Mapping) -> str | None:
    keyword = next((k for k in UNENFORCED_KEYWORDS if k in schema), None)
    if keyword is not None:
        return keyword
    if schema.get("uniqueItems") is True:
        return "uniqueItems"
    if "multipleOf" in schema and schema.get("type") != "integer":
        return "multipleOf outside type integer"
    shape = "pattern" if "pattern" in schema else "format" if schema.get("format") in XGRAMMAR_FORMATS else None
    length = next((k for k in ("minLength", "maxLength") if k in schema), None)
    if shape is not None and length is not None:
        return f"{length} with {shape}"
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return "allOf of several schemas"
    return None


def _subschemas(schema: Mapping, path: str):
    """(subschema, its dotted path) of each place in `schema` that holds one, in order."""
    def at(*keys) -> str:
        return ".".join(filter(None, (path, *keys))).replace(".[", "[")

    for key, value in schema.items():
        if key in SUBSCHEMA and isinstance(value, Mapping):
            yield value, at(key)
        elif key in SUBSCHEMA_LISTS and isinstance(value, list):
            yield from ((v, at(key, f"[{i}]")) for i, v in enumerate(value))
        elif key in SUBSCHEMA_MAPS and isinstance(value, Mapping):
            yield from ((v, at(key, str(name))) for name, v in value.items())
