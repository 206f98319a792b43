"""What a JSON-schema constraint may ask before it is compiled: only keywords the grammar backend
(xgrammar) really enforces, within size limits, and with a finite instance. Everything else is a
400 naming it, never output that silently breaks the schema, a compile that runs for minutes, or a
recursion that can only end at max_tokens.

Which draft 2020-12 keywords xgrammar enforces was measured by generating from each and validating
the output with `jsonschema` (tests/model/test_schema_keywords.py repeats it). Keywords outside
JSON Schema (OpenAPI's `discriminator`, vendor `x-*`) are ignored, as JSON Schema specifies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, cast

# draft 2020-12 assertions/applicators the grammar enforces (the rest of draft 2020-12 is refused,
# except the annotations below, which constrain nothing)
ENFORCED = frozenset({
    "type", "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "minLength", "maxLength", "pattern", "format", "items", "prefixItems", "minItems", "maxItems",
    "properties", "required", "additionalProperties", "anyOf", "$ref", "$defs", "definitions",
})  # allOf is enforced only as its first branch (measured): accepted with exactly one
ANNOTATIONS = frozenset({
    "$schema", "$id", "$anchor", "$comment", "$vocabulary", "title", "description", "default", "examples",
    "deprecated", "readOnly", "writeOnly", "contentEncoding", "contentMediaType", "contentSchema",
})
DRAFT_2020_12 = ENFORCED | ANNOTATIONS | frozenset({
    "$dynamicRef", "$dynamicAnchor", "allOf", "oneOf", "not", "if", "then", "else", "dependentSchemas", "contains",
    "minContains", "maxContains", "propertyNames", "patternProperties", "unevaluatedItems",
    "unevaluatedProperties", "uniqueItems", "minProperties", "maxProperties", "dependentRequired",
    "dependencies", "additionalItems",  # draft 7's spellings, still sent by older generators
})
# accepted only with the value that asks for nothing
_NEUTRAL = {"uniqueItems": (False,), "minProperties": (0,)}
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                  "additionalItems", "unevaluatedItems", "unevaluatedProperties", "contentSchema")


@dataclass(frozen=True)
class SchemaLimits:
    """OpenAI's documented structured-output limits where it has them (5,000 properties, 1,000 enum
    values, 120,000 characters of names and values); ours for the rest (OpenAI allows 10 levels of
    nesting, we allow 32; it states no byte limit, we take 128 KiB of schema, 16 KiB of regex and
    64 KiB of grammar)."""

    max_schema_bytes: int = 128 << 10
    max_properties: int = 5000
    max_enum_values: int = 1000
    max_string_chars: int = 120_000  # property names, definition names, enum and const values
    max_depth: int = 32  # nested subschemas
    max_regex_bytes: int = 16 << 10
    max_grammar_bytes: int = 64 << 10
    max_choices: int = 1000


class _Count:
    def __init__(self) -> None:
        self.properties = self.enum_values = self.chars = 0


def check_schema(schema: Any, limits: SchemaLimits = SchemaLimits()) -> None:
    """Raise ValueError naming the first keyword not enforced, the first limit exceeded, or a schema
    with no finite instance."""
    if len(json.dumps(schema)) > limits.max_schema_bytes:
        raise ValueError(f"the JSON schema is larger than {limits.max_schema_bytes} bytes")
    count = _Count()
    _walk(schema, "#", 0, limits, count, schema)
    if not has_finite_instance(schema):
        raise ValueError("the JSON schema has no finite instance: its recursion (through '$ref') never ends, "
                         "so output could only stop at max_tokens")


def _walk(node: Any, where: str, depth: int, limits: SchemaLimits, count: _Count, root: Any) -> None:
    if depth > limits.max_depth:
        raise ValueError(f"the JSON schema nests deeper than {limits.max_depth} levels (at {where})")
    if isinstance(node, list):
        for i, item in enumerate(node):
            _walk(item, f"{where}/{i}", depth, limits, count, root)
        return
    if not isinstance(node, dict):
        return
    for keyword, value in node.items():
        if keyword in DRAFT_2020_12 and keyword not in ENFORCED | ANNOTATIONS and \
                value not in _NEUTRAL.get(keyword, ()) and not (keyword == "oneOf" and _discriminated(node, root)) \
                and not (keyword == "allOf" and isinstance(value, list) and len(value) == 1):
            raise ValueError(f"the JSON schema keyword '{keyword}' (at {where}) is not enforced by the structured "
                             "output backend; remove it rather than get output that may break it")
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise ValueError(f"only local '$ref's (#/...) are supported; {ref!r} at {where} is not")
    _tally(node, where, limits, count)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                _walk(sub, f"{where}/{key}/{name}", depth + 1, limits, count, root)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            _walk(node[key], f"{where}/{key}", depth + 1, limits, count, root)
    for key in _SUBSCHEMA_ONE:
        if isinstance(node.get(key), (dict, list)):
            _walk(node[key], f"{where}/{key}", depth + 1, limits, count, root)


def _discriminated(node: dict, root: Any) -> bool:
    """A `oneOf` whose branches cannot overlap, as pydantic writes a discriminated union: each branch
    requires the `discriminator.propertyName` property with its own `const` (or one-value enum), so
    matching any one branch (what the grammar enforces) is matching exactly one."""
    branches, disc = node.get("oneOf"), node.get("discriminator")
    name = disc.get("propertyName") if isinstance(disc, dict) else None
    if not isinstance(branches, list) or not isinstance(name, str):
        return False
    tags = []
    for branch in branches:
        ref = branch.get("$ref") if isinstance(branch, dict) else None
        if isinstance(ref, str):
            branch = _ref_targets(root).get(ref)
        if not isinstance(branch, dict) or name not in (branch.get("required") or []):
            return False
        prop = (branch.get("properties") or {}).get(name)
        values = [prop["const"]] if isinstance(prop, dict) and "const" in prop else \
            prop.get("enum") if isinstance(prop, dict) and isinstance(prop.get("enum"), list) else None
        if values is None or len(values) != 1:
            return False
        tags.append(json.dumps(values[0], sort_keys=True))
    return len(set(tags)) == len(tags)


def _tally(node: dict, where: str, limits: SchemaLimits, count: _Count) -> None:
    for key in ("properties", "$defs", "definitions"):
        if isinstance(node.get(key), dict):
            count.chars += sum(len(str(name)) for name in node[key])
    if isinstance(node.get("properties"), dict):
        count.properties += len(node["properties"])
    if isinstance(node.get("enum"), list):
        count.enum_values += len(node["enum"])
        count.chars += sum(len(json.dumps(v)) for v in node["enum"])
    if "const" in node:
        count.chars += len(json.dumps(node["const"]))
    for what, n, limit in (("object properties", count.properties, limits.max_properties),
                           ("enum values", count.enum_values, limits.max_enum_values),
                           ("characters of names, enum and const values", count.chars, limits.max_string_chars)):
        if n > limit:
            raise ValueError(f"the JSON schema has more than {limit} {what} (at {where})")


def has_finite_instance(schema: Any) -> bool:
    """Whether some finite JSON value satisfies `schema` as the grammar generates it: the least fixed
    point over its local `$ref`s (a ref is productive once its target can be built from productive
    refs), then the root."""
    targets = _ref_targets(schema)
    productive = {ref: False for ref in targets}
    changed = True
    while changed:
        changed = False
        for ref, target in targets.items():
            if not productive[ref] and _productive(target, productive):
                productive[ref] = changed = True
    return _productive(schema, productive)


def _ref_targets(schema: Any) -> dict[str, Any]:
    targets: dict[str, Any] = {"#": schema}
    if isinstance(schema, dict):
        for key in ("$defs", "definitions"):
            if isinstance(schema.get(key), dict):
                targets |= {f"#/{key}/{name}": sub for name, sub in schema[key].items()}
    return targets


def _productive(node: Any, ok: dict[str, bool]) -> bool:
    if node is False:
        return False
    if not isinstance(node, dict):
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and ref in ok and not ok[ref]:
        return False
    if "const" in node or "enum" in node:
        return True
    if isinstance(node.get("allOf"), list) and not all(_productive(b, ok) for b in node["allOf"]):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and not any(_productive(b, ok) for b in node[key]):
            return False
    types = node.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else _implied_types(node)
    return any(_productive_as(t, node, ok) for t in types) if types else True


def _implied_types(node: dict) -> list[str]:
    if "properties" in node or "required" in node:
        return ["object"]
    if "items" in node or "prefixItems" in node:
        return ["array"]
    return []


def _productive_as(kind: str, node: dict, ok: dict[str, bool]) -> bool:
    if kind == "object":
        props = cast(dict, node.get("properties")) if isinstance(node.get("properties"), dict) else {}
        required = cast(list, node.get("required")) if isinstance(node.get("required"), list) else []
        return all(_productive(props[name], ok) for name in required if isinstance(name, str) and name in props)
    if kind == "array":
        prefix = cast(list, node.get("prefixItems")) if isinstance(node.get("prefixItems"), list) else []
        least = cast(int, node.get("minItems")) if isinstance(node.get("minItems"), int) else 0
        items = node.get("items", True)
        return all(_productive(prefix[i] if i < len(prefix) else items, ok) for i in range(min(least, len(prefix) + 1)))
    return True
