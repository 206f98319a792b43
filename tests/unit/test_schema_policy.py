"""The JSON-schema policy before any compile: keywords the backend does not enforce are refused by
name, wherever they sit; the size limits hold; a recursion without a finite instance is refused while
ordinary recursive schemas (a tree whose children may be empty) pass."""

from __future__ import annotations

import re

import pytest

from ferrylm.model.structured.schema_policy import ENFORCED, SchemaLimits, check_schema, has_finite_instance

NOT_ENFORCED = ["allOf", "oneOf", "not", "if", "dependentSchemas", "contains", "propertyNames", "patternProperties",
                "unevaluatedProperties", "unevaluatedItems", "minProperties", "maxProperties", "dependentRequired",
                "$dynamicRef", "uniqueItems"]


@pytest.mark.parametrize("keyword", NOT_ENFORCED)
def test_a_keyword_the_backend_does_not_enforce_is_refused_by_name_wherever_it_is(keyword):
    value = {"minProperties": 2, "maxProperties": 1, "uniqueItems": True, "allOf": [{}, {}]}.get(keyword, {})
    nested = {"type": "object", "properties": {"a": {"type": "array", "items": {keyword: value}}}}
    with pytest.raises(ValueError, match=re.escape(f"'{keyword}' (at #/properties/a/items)")):
        check_schema(nested)


def test_enforced_keywords_annotations_and_unknown_keywords_pass():
    check_schema({"title": "T", "description": "d", "type": "object", "discriminator": {"propertyName": "k"},
                  "properties": {"n": {"type": "integer", "multipleOf": 3, "minimum": 0, "default": 3},
                                 "s": {"type": "string", "pattern": "^a+$", "format": "date", "examples": ["x"]},
                                 "not": {"type": "boolean"}},  # a property named like a keyword
                  "required": ["n"], "additionalProperties": False, "uniqueItems": False,
                  "allOf": [{"type": "object"}]})
    assert "multipleOf" in ENFORCED


def test_limits():
    small = SchemaLimits(max_properties=3, max_enum_values=2, max_depth=2, max_schema_bytes=2000)
    with pytest.raises(ValueError, match="more than 3 object properties"):
        check_schema({"type": "object", "properties": {k: {} for k in "abcd"}}, small)
    with pytest.raises(ValueError, match="more than 2 enum values"):
        check_schema({"enum": [1, 2, 3]}, small)
    with pytest.raises(ValueError, match="deeper than 2"):
        check_schema({"items": {"items": {"items": {"type": "integer"}}}}, small)
    with pytest.raises(ValueError, match="larger than 2000 bytes"):
        check_schema({"description": "x" * 3000}, small)
    with pytest.raises(ValueError, match="120000 characters"):
        check_schema({"enum": ["x" * 60_001, "y" * 60_001]})


def test_recursion_without_a_finite_instance_is_refused():
    forever = {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}},
                                  "required": ["next"]}}, "$ref": "#/$defs/node"}
    assert not has_finite_instance(forever)
    with pytest.raises(ValueError, match="no finite instance"):
        check_schema(forever)
    mutual = {"$defs": {"a": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/b"}},
                        "b": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}
    assert not has_finite_instance(mutual)
    root = {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}
    assert not has_finite_instance(root)
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["children"]}},
        "$ref": "#/$defs/node"}
    assert has_finite_instance(tree)  # children may be []
    either = {"$defs": {"n": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
        "next": {"$ref": "#/$defs/n"}}, "required": ["next"]}]}}, "$ref": "#/$defs/n"}
    assert has_finite_instance(either)
    check_schema(tree)
    check_schema(either)


def test_a_pydantic_discriminated_union_is_the_one_oneof_accepted():
    from typing import Literal

    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int

    class Dog(BaseModel):
        kind: Literal["dog"]
        good: bool

    class Owner(BaseModel):
        pet: Cat | Dog = Field(discriminator="kind")

    schema = Owner.model_json_schema()
    check_schema(schema)
    overlapping = schema | {"$defs": schema["$defs"] | {"Dog": schema["$defs"]["Cat"]}}
    with pytest.raises(ValueError, match="'oneOf'"):
        check_schema(overlapping)
