"""Regenerate the key tables of docs/configuration.md from the installed schema.

    python docs/gen_config_reference.py > /tmp/tables.md

The tables are derived from the option declarations (core and plugins) and the Accelerate key
table, so they cannot drift from the code; tests/repository/test_docs.py checks the document against them.
"""

from __future__ import annotations

import sys

from torchrig.config.compat import ACCELERATE_KEYS
from torchrig.config.flags import collect_flags
from torchrig.config.readers import env_name
from torchrig.config.resolve import Schema
from torchrig.host.plugin_host import PluginHost


def _default(value: object) -> str:
    return "`[]`" if value == [] else f"`{value!r}`"


def key_rows(schema: Schema) -> list[str]:
    flags: dict[str, list[str]] = {}
    for flag in collect_flags(schema):
        flags.setdefault(flag.key, []).append(flag.flag if flag.const is None else f"{flag.flag} (= {flag.const})")
    rows = ["| key | default | environment variable | flags | meaning |", "|---|---|---|---|---|"]
    for key in schema.all_keys():
        spec = schema.spec(key)
        section = key.rpartition(".")[0]
        default = schema.sections[section].default if section else None
        value = getattr(default, spec.name) if default is not None else (spec.default() if spec.has_default else None)
        aliases = f" (also: {', '.join(spec.info.aliases)})" if spec.info.aliases else ""
        env = f"`{env_name(key)}`" if spec.info.env and not spec.info.python_only else "— (Python only)"
        rows.append(f"| `{key}`{aliases} | {_default(value)} | {env} | {' '.join(f'`{f}`' for f in flags.get(key, [])) or '—'} "
                    f"| {spec.info.help} |")
    return rows


def section_rows(schema: Schema) -> list[str]:
    rows = ["| section | options class | declared by |", "|---|---|---|"]
    for key, section in schema.sections.items():
        rows.append(f"| `{key}` | `{schema.options(key).__name__}` | {schema.section_owner[key]} |")
    return rows


def accelerate_rows() -> list[str]:
    rows = ["| Accelerate key | torchrig | why / where |", "|---|---|---|"]
    for entry in ACCELERATE_KEYS:
        status = {"supported": "supported", "no_effect": "accepted, no effect", "rejected": "rejected"}[entry.status]
        rows.append(f"| `{entry.key}` | {status} | {entry.note} |")
    return rows


#: The reference documents torchrig's own distributions; other installed plugins (the example
#: plugin in examples/localsgd, a user's) document their sections themselves.
FIRST_PARTY = ("torchrig", "torchrig-ddp", "torchrig-fsdp", "torchrig-deepspeed", "torchrig-trackers",
               "torchrig-ray", "torchrig-fp8", "torchrig-ft")


def first_party_host() -> PluginHost:
    others = [info.key for info in PluginHost(register_defaults=False).plugins()
              if all(record.distribution not in FIRST_PARTY for record in info.records)]
    return PluginHost(disabled=others)


def main() -> int:
    schema = Schema(first_party_host())
    for title, rows in (("Sections", section_rows(schema)), ("Keys", key_rows(schema)),
                        ("Accelerate's keys", accelerate_rows())):
        print(f"### {title}\n")
        print("\n".join(rows))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
