"""A request's structured-output fields -> the engine's GrammarSpec (engine/sample/grammar.py).

`response_format` (OpenAI: json_object, json_schema) on both endpoints, and vLLM's extension
`structured_outputs` (json, regex, choice, grammar, json_object) with its older `guided_*`
spellings. At most one may constrain a request; tool calls bring their own (server/tools.py).
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine import GrammarSpec
from server.errors import APIError
from server.protocol import SamplingRequest
from server.state import ServerState

MAX_GRAMMAR_BYTES = 256 << 10
"""A grammar's source: a schema as JSON, a regex, a Lark grammar, the choices, the tools'."""
MAX_SCHEMA_DEPTH = 64
"""Objects and arrays nested in a schema (a nested pydantic model takes two)."""
COMPILE_TIMEOUT = 10.0
"""Seconds a grammar may take to compile (llguidance's own fuel limits bound it too)."""
_COMPILERS = ThreadPoolExecutor(2, thread_name_prefix="grammar")  # not the default pool

_COMBINERS = (
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "if",
    "then",
    "else",
    "$ref",
    "patternProperties",
    "unevaluatedProperties",
    "dependentSchemas",
)
# Where closing a subschema keeps the output valid for the original. Not under not, if/then/
# else, contains or dependentSchemas: closing there changes what the original accepts (a
# closed `not` lets through what the open one refused); llguidance refuses those anyway.
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMAS = ("items", "additionalProperties")


def closed(schema: Any, close: bool = True) -> Any:
    """A copy of a JSON schema in which an object that lists its properties and says nothing
    of others allows no others (as OpenAI's strict mode requires of every object). Small
    models otherwise keep inventing keys; the output still validates against the original.
    Objects combined with others (allOf, anyOf, $ref...) are left as they are: closing one
    branch of an allOf would refuse the other branch's keys."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    combined = any(key in schema for key in _COMBINERS)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed(sub, close) for name, sub in schema[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            keep = close and key != "allOf"  # allOf's branches are merged: never close one
            out[key] = [closed(sub, keep) for sub in schema[key]]
    for key in _SCHEMAS:
        if isinstance(schema.get(key), dict):
            out[key] = closed(schema[key], close)
    if close and not combined and isinstance(schema.get("properties"), dict):
        out.setdefault("additionalProperties", False)
    return out


def check_schema_depth(schema: Any, param: str) -> None:
    """A 400 naming `param` for a schema nested deeper than MAX_SCHEMA_DEPTH."""
    level: list[Any] = [schema]
    for _ in range(MAX_SCHEMA_DEPTH + 1):
        level = [
            child
            for item in level
            for child in (item.values() if isinstance(item, dict) else item)
            if isinstance(child, (dict, list))
        ]
        if not level:
            return
    raise APIError(
        f"The JSON schema nests objects and arrays more than {MAX_SCHEMA_DEPTH} deep.",
        400,
        param=param,
    )


def _schema_text(schema: dict[str, Any] | str, param: str) -> str:
    try:
        if isinstance(schema, str):
            if len(schema) > MAX_GRAMMAR_BYTES:
                raise APIError(_too_long(len(schema)), 400, param=param)
            schema = json.loads(schema)
        if not isinstance(schema, dict):
            raise APIError("The JSON schema must be a JSON object.", 400, param=param)
        check_schema_depth(schema, param)
        return json.dumps(closed(schema))  # key order kept: properties are generated in it
    except (json.JSONDecodeError, RecursionError) as exc:
        raise APIError(f"The JSON schema is not usable JSON: {exc}", 400, param=param) from exc


def grammar_for(req: SamplingRequest, number_digits: int = 0) -> GrammarSpec | None:
    """The grammar the request's fields ask for, or None; a 400 if they ask for several.
    JSON output's numbers take at most `number_digits` digits (0: no limit)."""
    found: list[GrammarSpec] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(GrammarSpec("json_object", "", "response_format", number_digits))
    elif fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None:
        schema = _schema_text(fmt.json_schema.schema_ or {}, "response_format")
        found.append(GrammarSpec("json_schema", schema, "response_format", number_digits))
    so = req.structured_outputs
    for param, value, kind in [
        ("structured_outputs", so.json_ if so else None, "json_schema"),
        ("structured_outputs", so.regex if so else None, "regex"),
        ("structured_outputs", so.choice if so else None, "choice"),
        ("structured_outputs", so.grammar if so else None, "lark"),
        ("structured_outputs", True if so and so.json_object else None, "json_object"),
        ("guided_json", req.guided_json, "json_schema"),
        ("guided_regex", req.guided_regex, "regex"),
        ("guided_choice", req.guided_choice, "choice"),
        ("guided_grammar", req.guided_grammar, "lark"),
    ]:
        if value is None:
            continue
        if kind == "json_schema":
            source = _schema_text(value, param)
        elif kind == "choice":
            source = json.dumps(value)
        else:
            source = "" if kind == "json_object" else value
        digits = number_digits if kind in ("json_schema", "json_object") else 0
        found.append(GrammarSpec(kind, source, param, digits))
    if len(found) > 1:
        raise APIError(
            "Ask for one structured output at a time (response_format, structured_outputs or "
            "a guided_* field).",
            400,
            param=found[1].param,
        )
    return found[0] if found else None


def _too_long(size: int) -> str:
    return f"The grammar is {size} bytes long; the limit is {MAX_GRAMMAR_BYTES}."


async def compile_grammar(state: ServerState, spec: GrammarSpec | None) -> None:
    """Compile the grammar on the grammar threads (cached by the engine); a 400 if it is too
    large, fails or takes longer than COMPILE_TIMEOUT."""
    if spec is None:
        return
    from engine import InvalidRequest

    size = len(spec.source.encode("utf-8", "surrogatepass"))
    if size > MAX_GRAMMAR_BYTES:
        raise APIError(_too_long(size), 400, param=spec.param, code="invalid_grammar")
    engine = state.ready_engine()
    compiling = asyncio.get_running_loop().run_in_executor(_COMPILERS, engine.check_grammar, spec)
    try:
        await asyncio.wait_for(compiling, COMPILE_TIMEOUT)
    except asyncio.TimeoutError as exc:  # not the builtin before Python 3.11
        message = f"The grammar did not compile within {COMPILE_TIMEOUT:g} seconds."
        raise APIError(message, 400, param=spec.param, code="invalid_grammar") from exc
    except InvalidRequest as exc:
        raise APIError(str(exc), 400, param=exc.param, code=exc.code) from exc
