"""Untrusted YAML (and JSON, which YAML reads too) into plain data, within bounds; the config file and the node
snapshot are read through here.

PyYAML's safe loader builds nothing dangerous, but it follows aliases: a file of a few hundred bytes whose aliases
refer to aliases (a "billion laughs") is a billion values to whoever walks it. The loader here counts what a
document holds with every alias expanded, while it is composed, and refuses it past `MAX_VALUES` (counting plain
values as they are read, so that a long flat list is refused halfway rather than built whole); it also refuses
nesting past `MAX_DEPTH` (before Python's recursion limit) and numbers of more than `MAX_NUMBER_CHARS` characters
(before Python's limit on integer conversion).
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from mpsagent.base.errors import DocumentError, shown

MAX_VALUES = 100_000
"""Values (scalars, lists and mappings) a document may hold with its aliases expanded; a config holds dozens."""
MAX_DEPTH = 64
MAX_NUMBER_CHARS = 100


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [part for pair in node.value for part in pair]
    return []


class _BoundedLoader(yaml.SafeLoader):
    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._composed = 0  # nodes composed so far: bounds the work before any alias is expanded
        self._expanded: dict[int, int] = {}  # id(node) -> values it holds, aliases expanded; set once composed

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        is_alias = self.check_event(yaml.AliasEvent)
        event = self.current_event  # what check_event looked at
        if is_alias:
            anchor = str(event.anchor)
            target = self.anchors.get(anchor)
            if target is not None and id(target) not in self._expanded:
                raise DocumentError(
                    f"refers to itself through the alias *{shown(anchor)} at {_where(event.start_mark)}"
                )
        elif self._depth >= MAX_DEPTH:
            raise DocumentError(f"nests deeper than {MAX_DEPTH} levels at {_where(event.start_mark)}")
        else:
            self._composed += 1
            if self._composed > MAX_VALUES:
                raise DocumentError(f"holds more than {MAX_VALUES} values (at {_where(event.start_mark)})")
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if node is not None and id(node) not in self._expanded:
            values = 1 + sum(self._expanded[id(child)] for child in _children(node))
            if values > MAX_VALUES:
                raise DocumentError(
                    f"holds more than {MAX_VALUES} values once its aliases are expanded "
                    f"(at {_where(node.start_mark)}); write it out plainly, with few aliases"
                )
            self._expanded[id(node)] = values
        return node

    def construct_yaml_int(self, node: ScalarNode) -> int:
        digits = len(str(node.value))
        if digits > MAX_NUMBER_CHARS:
            raise DocumentError(f"holds a number of {digits} digits at {_where(node.start_mark)}")
        return int(super().construct_yaml_int(node))


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def _where(mark: yaml.Mark | None) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark else "an unknown place"


def load_yaml(text: str) -> Any:
    """One YAML or JSON document as plain Python data (None for an empty one); raises DocumentError, whose message
    reads after the document's name (`config.yaml` + ` is not valid YAML or JSON at line 3, column 1`)."""
    try:
        loader = _BoundedLoader(text)  # reading starts here: it refuses control characters
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise DocumentError(f"is not valid YAML or JSON{' at ' + _where(mark) if mark else ''}") from exc
    except ValueError as exc:  # a value the resolver took for a date or number that is none (2024-13-45)
        raise DocumentError(f"holds a value that cannot be read ({shown(exc)})") from exc
