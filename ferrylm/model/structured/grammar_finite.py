"""Whether an EBNF grammar has any finite output at all (`root ::= "a" root` has none).

xgrammar compiles such a grammar, and a request under it can only run to max_tokens: every token keeps
the match open and no stop token is ever allowed. The constraint is refused instead (a 400 naming the
field), as a JSON schema whose `$ref` recursion never ends is (schema_policy.py).

The check is the textbook one for context-free grammars: a rule is productive when one of its
alternatives is a sequence of productive items (a string, a character class, an item that may repeat
zero times, a productive rule), iterated to a fixed point; the grammar has a finite output when `root` is
productive. It reads the grammar as xgrammar prints it after parsing (`str(Grammar)`: one rule per line,
nested groups already lifted into rules of their own). Anything it does not recognise counts as
productive, so an unfamiliar construct never refuses a grammar.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(r'''\s*(?:
    (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])(?P<star>\*)?
  | (?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)(?P<repeat>\{\s*(?P<low>\d+)\s*(?:,[^}]*)?\})?(?P<mark>[*?+])?
  | (?P<punct>\(=|\(|\)|\|)
)''', re.VERBOSE)

_Item = tuple[str, str, int]  # ("term", "", 0) | ("rule", name, fewest repeats) | ("group", "", index)
_Choice = list[list[_Item]]


class _Unknown(Exception):
    """A construct this reader does not know: the grammar is taken as having a finite output."""


def has_finite_output(grammar_text: str, root: str = "root") -> bool:
    """Whether `root` of the grammar printed by xgrammar (`str(xgrammar.Grammar)`) derives some finite
    string. True when the text cannot be read (the check then refuses nothing)."""
    try:
        rules, groups = _parse(grammar_text)
    except _Unknown:
        return True
    if root not in rules:
        return True
    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, choice in rules.items():
            if name not in productive and _choice_ok(choice, productive, groups):
                productive.add(name)
                changed = True
    return root in productive


def _choice_ok(choice: _Choice, productive: set[str], groups: list[_Choice]) -> bool:
    return any(all(_item_ok(item, productive, groups) for item in seq) for seq in choice)


def _item_ok(item: _Item, productive: set[str], groups: list[_Choice]) -> bool:
    kind, name, low = item
    if kind == "term":
        return True
    if kind == "group":
        return _choice_ok(groups[low], productive, groups)
    return low == 0 or name in productive


def _parse(text: str) -> tuple[dict[str, _Choice], list[_Choice]]:
    rules: dict[str, _Choice] = {}
    groups: list[_Choice] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        name, sep, body = line.partition("::=")
        if not sep or not re.fullmatch(r"\s*[A-Za-z_][A-Za-z0-9_.\-]*\s*", name):
            raise _Unknown(line)
        tokens = _tokens(body)
        choice, end = _choice(tokens, 0, groups)
        if end != len(tokens):
            raise _Unknown(line)
        rules[name.strip()] = choice
    return rules, groups


def _tokens(body: str) -> list[re.Match]:
    out, pos = [], 0
    while body[pos:].strip():
        match = _TOKEN.match(body, pos)
        if match is None or match.end() == pos:
            raise _Unknown(body[pos:pos + 40])
        out.append(match)
        pos = match.end()
    return out


def _choice(tokens: list[re.Match], i: int, groups: list[_Choice]) -> tuple[_Choice, int]:
    """Alternatives from tokens[i] up to an unmatched ")" or the end."""
    choice: _Choice = [[]]
    while i < len(tokens):
        t = tokens[i]
        punct = t.group("punct")
        if punct == ")":
            break
        if punct == "|":
            choice.append([])
            i += 1
        elif punct == "(=":  # a lookahead assertion: it consumes nothing
            _, i = _choice(tokens, i + 1, groups)
            i = _close(tokens, i)
        elif punct == "(":
            inner, i = _choice(tokens, i + 1, groups)
            i = _close(tokens, i)
            groups.append(inner)
            choice[-1].append(("group", "", len(groups) - 1))
        elif t.group("string") is not None or t.group("cls") is not None:
            choice[-1].append(("term", "", 0))
            i += 1
        else:
            mark, low = t.group("mark"), t.group("low")
            fewest = 0 if mark in ("*", "?") else int(low) if low is not None else 1
            choice[-1].append(("rule", t.group("name"), fewest))
            i += 1
    return choice, i


def _close(tokens: list[re.Match], i: int) -> int:
    if i >= len(tokens) or tokens[i].group("punct") != ")":
        raise _Unknown("unbalanced parentheses")
    return i + 1
