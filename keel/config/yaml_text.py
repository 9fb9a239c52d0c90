"""The YAML of config files, `--set` values and the run dir's config.yaml: one reader and one writer.

PyYAML follows YAML 1.1, where `1e-3` is a string (a float needs a dot) and `10:20` is the base-60 integer 620;
so a corpus weight of `1e-3` was refused as text and a skip range `10:20` became a number. Here numbers read as
YAML 1.2 (and JSON, which `--set` values often are) write them: decimal, 0x/0o/0b integers, floats with or without
a dot, .inf and .nan. The writer resolves with the same table, so every string it writes reads back as a string.
libyaml's parser and emitter are used when PyYAML has them (about 20x faster on a whole config).
"""

from __future__ import annotations

import re
from typing import Any

import yaml

INT_TAG, FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
INT = re.compile(r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0x[0-9a-fA-F_]+|0o[0-7_]+|0b[01_]+)$")
FLOAT = re.compile(
    r"""^(?:[-+]?(?=\.?[0-9])(?:[0-9][0-9_]*)?\.[0-9_]*(?:[eE][-+]?[0-9]+)?  # a dot and a digit
                       |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+  # an exponent
                       |[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""",
    re.X,
)


def _resolvers(base: dict) -> dict:
    """`base`'s implicit resolvers with YAML 1.1's int and float rules replaced by INT and FLOAT."""
    table = {
        first: [(tag, rx) for tag, rx in rules if tag not in (INT_TAG, FLOAT_TAG)]
        for first, rules in base.items()
    }
    for first in "-+0123456789.":
        table.setdefault(first, []).extend([(INT_TAG, INT), (FLOAT_TAG, FLOAT)])
    return table


_BaseLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_BaseDumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class ConfigLoader(_BaseLoader):  # type: ignore[misc, valid-type]
    yaml_implicit_resolvers = _resolvers(yaml.SafeLoader.yaml_implicit_resolvers)


class ConfigDumper(_BaseDumper):  # type: ignore[misc, valid-type]
    yaml_implicit_resolvers = _resolvers(yaml.SafeDumper.yaml_implicit_resolvers)


def _construct_int(loader: yaml.BaseLoader, node: yaml.Node) -> int:
    text = loader.construct_scalar(node).replace("_", "")
    return int(text, 0) if text[:2] in ("0x", "0o", "0b") else int(text, 10)


ConfigLoader.add_constructor(INT_TAG, _construct_int)


def parse_yaml(text: str) -> Any:
    """`text` as Python data; a yaml.YAMLError when it is not YAML."""
    return yaml.load(text, Loader=ConfigLoader)


def dump_yaml(data: Any) -> str:
    """`data` as block YAML, keys in their order, reading back equal through `parse_yaml`."""
    return yaml.dump(data, Dumper=ConfigDumper, sort_keys=False, allow_unicode=True)
