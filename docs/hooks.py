"""MkDocs hooks: the HTTP API reference page, rendered from the app's own OpenAPI schema; and
the README's status table on the home page with its links made relative to `docs/`.

At every `mkdocs build` or `mkdocs serve` this builds the FastAPI app with default settings
(`create_app(Settings()).openapi()`: the lifespan never runs, so no model, database or engine is
opened) and adds `reference/http-api.md` to the site as a generated page: every route, its
parameters, request body and responses, and the schemas they use. Nothing is committed, so the
page always matches the routes of the code being built. Run alone, it prints the page:

    .venv/bin/python docs/hooks.py > /tmp/http-api.md

This is part of building the docs, not of rlproxy (registered in mkdocs.yml under `hooks`).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PAGE = "reference/http-api.md"

INTRO = """\
# HTTP API reference

<!-- Generated at build time by docs/hooks.py from the app's OpenAPI schema. -->

Every route in the OpenAPI schema of `rlproxy serve`, generated from the code at each docs
build. How the routes behave is told on [HTTP API](../api.md), [Wire protocols](../protocols.md)
and the concept pages. A running server serves the same schema at `/openapi.json` and renders it
at `/docs` (an admin key is needed once keys exist; see [Security](../security.md)).

One difference from the schema as FastAPI writes it: a request that does not validate is a
**400** in its protocol's error shape (OpenAI's `{"error": {"message", "type", "param", "code"}}`,
Anthropic's on `/v1/messages`), not a 422, so the 422 entries are left out below.
"""


README_SECTION = re.compile(r'^--8<-- "README\.md:(?P<name>[\w-]+)"$', re.MULTILINE)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs hook: put a README section (`--8<-- "README.md:NAME"`) into a page, its links
    rewritten from the repository's root (`docs/x.md`) to the page's folder (`x.md`): the README
    links into `docs/` from the root, the site's pages live inside it. Only the home page may
    include README sections (its links are rewritten for `docs/` itself)."""
    if page.file.src_uri != "index.md":
        return markdown
    return README_SECTION.sub(lambda m: readme_section(m.group("name")), markdown)


def readme_section(name: str) -> str:
    text = (ROOT / "README.md").read_text()
    start, end = f"<!-- --8<-- [start:{name}] -->", f"<!-- --8<-- [end:{name}] -->"
    if start not in text or end not in text:
        raise ValueError(f"README.md has no section {name!r} ({start} ... {end})")
    section = text.split(start, 1)[1].split(end, 1)[0]
    return re.sub(r"\]\(docs/", "](", section)


def on_files(files: Any, config: Any) -> Any:
    """MkDocs hook: add the generated page to the site's files."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    return files


def build_app() -> Any:
    sys.path.insert(0, str(ROOT))
    from proxy.api.app import create_app
    from proxy.settings import Settings

    return create_app(Settings())


def render(app: Any = None) -> str:
    app = app if app is not None else build_app()
    schema = app.openapi()
    out = [INTRO]
    by_tag = group_routes(schema["paths"])
    out.append("## Routes\n")
    out.append("| method | path | summary |\n| --- | --- | --- |")
    for _, ops in by_tag:
        for path, method, op in ops:
            link = f"[`{path}`](#{anchor(method, path)})"
            out.append(f"| `{method.upper()}` | {link} | {op.get('summary', '')} |")
    hidden = hidden_routes(app)
    if hidden:
        out.append(
            "\nServed but not in the schema: " + ", ".join(f"`{m} {p}`" for m, p in hidden) + "."
        )
    for title, ops in by_tag:
        out.append(f"\n## {title}\n")
        for path, method, op in ops:
            out.append(operation(path, method, op))
    components = schema.get("components", {}).get("schemas", {})
    used = sorted(n for n in components if n not in ("HTTPValidationError", "ValidationError"))
    if used:
        out.append("\n## Schemas\n")
        for name in used:
            out.append(schema_section(name, components[name]))
    return "\n".join(out).rstrip() + "\n"


def group_routes(paths: dict[str, Any]) -> list[tuple[str, list[tuple[str, str, Any]]]]:
    """Routes under headings by their first two path segments (`/v1/chat`, `/rl/groups`)."""
    groups: dict[str, list[tuple[str, str, Any]]] = {}
    for path, item in paths.items():
        parts = [p for p in path.split("/") if p and not p.startswith("{")]
        title = "/" + "/".join(parts[:2]) if parts else "/"
        for method, op in item.items():
            groups.setdefault(title, []).append((path, method, op))
    return list(groups.items())


def hidden_routes(app: Any) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []

    def walk(routes: list[Any]) -> None:
        for route in routes:
            inner = getattr(route, "original_router", None) or getattr(route, "app", None)
            if hasattr(inner, "routes") and not hasattr(route, "methods"):
                walk(inner.routes)
            elif route.__class__.__name__ == "APIRoute" and not route.include_in_schema:
                for method in sorted(route.methods):
                    found.append((method, route.path))

    walk(app.routes)
    return found


def anchor(method: str, path: str) -> str:
    slug = "".join(c if c.isalnum() else "-" for c in f"{method} {path}".lower())
    return "-".join(p for p in slug.split("-") if p)


def operation(path: str, method: str, op: dict[str, Any]) -> str:
    lines = [f"### `{method.upper()} {path}` {{#{anchor(method, path)}}}\n"]
    if op.get("summary"):
        lines.append(f"{op['summary']}.\n")
    if op.get("description"):
        lines.append(op["description"].strip() + "\n")
    params = op.get("parameters", [])
    if params:
        lines.append(
            "| parameter | in | type | required | meaning |\n| --- | --- | --- | --- | --- |"
        )
        for p in params:
            s = p.get("schema", {})
            lines.append(
                f"| `{p['name']}` | {p['in']} | {cell(type_of(s))} | "
                f"{'yes' if p.get('required') else 'no'} | "
                f"{cell(p.get('description') or s.get('description', ''))}{default_of(s)} |"
            )
        lines.append("")
    body = op.get("requestBody")
    if body:
        for kind, content in body.get("content", {}).items():
            lines.append(f"Body ({kind}): {type_of(content.get('schema', {}))}.\n")
    responses = [(c, r) for c, r in op.get("responses", {}).items() if c != "422"]
    if responses:
        shown = []
        for code, resp in responses:
            schemas = [type_of(c.get("schema", {})) for c in resp.get("content", {}).values()]
            shown.append(
                f"`{code}` {resp.get('description', '')}"
                + (f": {', '.join(schemas)}" if any(schemas) else "")
            )
        lines.append("Responses: " + "; ".join(shown) + ".\n")
    return "\n".join(lines)


def schema_section(name: str, schema: dict[str, Any]) -> str:
    lines = [f"### {name}\n"]
    if schema.get("description"):
        lines.append(" ".join(schema["description"].split()) + "\n")
    props = schema.get("properties", {})
    if "enum" in schema:
        lines.append("One of " + ", ".join(f"`{v}`" for v in schema["enum"]) + ".\n")
    if props:
        required = set(schema.get("required", []))
        lines.append("| field | type | required | meaning |\n| --- | --- | --- | --- |")
        for field, s in props.items():
            lines.append(
                f"| `{field}` | {cell(type_of(s))} | {'yes' if field in required else 'no'} | "
                f"{cell(s.get('description', ''))}{default_of(s)} |"
            )
        lines.append("")
    return "\n".join(lines)


def type_of(s: dict[str, Any]) -> str:
    if not s:
        return ""
    if "$ref" in s:
        name = s["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    for key in ("anyOf", "oneOf"):
        if key in s:
            kinds = [type_of(x) for x in s[key] if x.get("type") != "null"]
            nullable = any(x.get("type") == "null" for x in s[key])
            return " or ".join(k for k in kinds if k) + (" or null" if nullable else "")
    if "const" in s:
        return f"`{json.dumps(s['const'])}`"
    if "enum" in s:
        return " / ".join(f"`{v}`" for v in s["enum"])
    kind = s.get("type", "any")
    if kind == "array":
        return f"array of {type_of(s.get('items', {})) or 'any'}"
    if (
        kind == "object"
        and "additionalProperties" in s
        and isinstance(s["additionalProperties"], dict)
    ):
        return f"object of {type_of(s['additionalProperties']) or 'any'}"
    bounds = [
        f"{sign} {s[k]}"
        for k, sign in (
            ("minimum", "≥"),
            ("maximum", "≤"),
            ("exclusiveMinimum", ">"),
            ("exclusiveMaximum", "<"),
        )
        if k in s
    ]
    return str(kind) + (f" ({', '.join(bounds)})" if bounds else "")


def default_of(s: dict[str, Any]) -> str:
    if "default" not in s or s["default"] is None:
        return ""
    return f" Default `{json.dumps(s['default'])}`."


def cell(text: str) -> str:
    """One Markdown table cell: no pipes or newlines; `<` outside code spans is not a tag."""
    parts = " ".join(str(text).split()).replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


if __name__ == "__main__":
    sys.stdout.write(render())
