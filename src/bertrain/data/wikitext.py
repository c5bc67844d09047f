"""MediaWiki markup -> plain text (`strip_wiki_markup`): how the `wiki` reader's articles are cleaned.

Templates, tables, references, files, categories and tail sections (References, See also, ...) are removed;
links become their text. Cheap regex passes remove the bulk of the markup first, mwparserfromhell parses the rest.
"""
from __future__ import annotations

import re

import mwparserfromhell
import mwparserfromhell.nodes as N

_DROP_TAGS = frozenset("""ref references table gallery math chem ce score timeline imagemap graph mapframe
maplink syntaxhighlight source pre code templatedata templatestyles hiero inputbox categorytree poem
nowiki noinclude includeonly onlyinclude div span sup sub small big center font""".split()) - {
    "span", "sup", "sub", "small", "big", "center", "font", "nowiki", "div", "poem"}
_KEEP_CONTENT_TAGS = frozenset("b i u s strong em span small big sup sub center font abbr cite q nowiki div poem "
                               "blockquote li dd dt p tt var kbd".split())
_DROP_SECTIONS = frozenset({"references", "external links", "see also", "further reading", "notes", "bibliography",
                            "sources", "footnotes", "citations", "notes and references", "works cited"})
# Links MediaWiki does not show in the running text: files and images (their captions are no sentences of the
# article), categories, and interlanguage links ([[de:Paris]]: listed in the sidebar). A link led by a colon
# ([[:de:Paris|Paris]], [[:Category:X|X]]) is shown inline, as are links with a label to other projects
# ([[wikt:brigand|brigand]]); those without a label would show their prefix ("wikt:brigand"), so are dropped.
_LINK_DROP_PREFIXES = ("file:", "image:", "category:", "media:")
_LABELLED_ONLY_PREFIXES = ("wikt:", "wiktionary:", "s:", "commons:")
# A language prefix: "de:Paris", "zh-yue:..." (no space after the colon: "[[Ben-Hur: A Tale of the Christ]]" is an
# article).
_INTERWIKI = re.compile(r"^[a-z]{2,3}(-[a-z]+)?:(?! )")
_LEFTOVER_REF = re.compile(r"<ref[^>]*/>|<ref[^>]*>.*?</ref>|</?ref[^>]*>", re.IGNORECASE | re.DOTALL)
_LEFTOVER_TAG = re.compile(r"</?[a-zA-Z][^<>]{0,200}>")
_LEFTOVER_MARKUP = re.compile(r"\{\{|\}\}|\[\[|\]\]|\{\||\|\}|'{2,}")
_MULTI_SPACE = re.compile(r" {2,}")
_SPACE_PUNCT = re.compile(r" +([.,;:!?](?:\s|$))")
_TABLE_LINE = re.compile(r"^\s*(\{\||\|\}|\|-|\||!)")


_PRE_COMMENT = re.compile(r"<!--.*?(-->|$)", re.DOTALL)
# Behaviour switches (__NOTOC__, __TOC__, __NOEDITSECTION__, ...): page settings, never shown as text.
# Only MediaWiki's own: "__FILE__" in an article on C is text.
_MAGIC_WORD = re.compile(r"__(?:NOTOC|FORCETOC|TOC|NOEDITSECTION|NEWSECTIONLINK|NONEWSECTIONLINK|NOGALLERY|HIDDENCAT|"
                         r"EXPECTUNUSEDCATEGORY|NOCONTENTCONVERT|NOCC|NOTITLECONVERT|NOTC|INDEX|NOINDEX|"
                         r"STATICREDIRECT|DISAMBIG|NOGLOBAL|EXPECTUNUSEDTEMPLATE|START|END)__")
_PRE_REF = re.compile(r"<ref\b[^>]*/>|<ref\b[^>]*>.*?</ref\s*>", re.IGNORECASE | re.DOTALL)
_BRACES = re.compile(r"\{\{|\}\}")


def _remove_templates(text: str) -> str:
    """Drop balanced {{...}} spans (templates carry no running text) with one C-regex scan.

    Why before mwparserfromhell: templates and citation references are most of an article's markup, and building
    their node trees in mwparserfromhell's Python builder was most of the cleaning time (profiled on the shared
    Wikipedia sample); removing them first makes `strip_wiki_markup` much cheaper.
    """
    out: list[str] = []
    depth = 0
    last = 0
    for m in _BRACES.finditer(text):
        if m.group() == "{{":
            if depth == 0:
                out.append(text[last:m.start()])
            depth += 1
        elif depth:
            depth -= 1
            if depth == 0:
                last = m.end()
    if depth == 0:
        out.append(text[last:])
    return "".join(out)


# A plain internal link: no nested brackets, braces, tags or newlines in it (those are left to mwparserfromhell).
_PRE_LINK = re.compile(r"\[\[([^\[\]{}<>|\n]+)(?:\|([^\[\]{}<>\n]*))?\]\]")


def _hidden_link(title: str, labelled: bool) -> bool:
    """Whether a wikilink to `title` shows nothing in the article's text (see `_LINK_DROP_PREFIXES`)."""
    low = title.lower()
    return low.startswith(_LINK_DROP_PREFIXES) or _INTERWIKI.match(low) is not None or (
        not labelled and low.startswith(_LABELLED_ONLY_PREFIXES))


def _link_text(m: re.Match) -> str:
    """What `_render_node` gives for a plain wikilink, done on the source text (see `strip_wiki_markup`)."""
    title, text = m.group(1).strip(), m.group(2)
    if _hidden_link(title, text is not None):
        return ""
    if text is not None:
        return text
    return title.lstrip(":").split("#")[0] if not title.startswith("#") else title[1:]


_TABLE_EDGE = re.compile(r"^[ \t]*(\{\||\|\})", re.MULTILINE)
_LIST_MARK = re.compile(r"^[*#]+", re.MULTILINE)


def _remove_tables(text: str) -> str:
    """Drop balanced tables ({| at a line start .. |} at a line start) like `_remove_templates` drops templates:
    the renderer drops every table anyway, and their cells were ~40% of the nodes left for mwparserfromhell.
    An unclosed table is left to mwparserfromhell."""
    if "{|" not in text:
        return text
    out: list[str] = []
    depth = 0
    last = 0
    opened = 0
    for m in _TABLE_EDGE.finditer(text):
        if m.group(1) == "{|":
            if depth == 0:
                out.append(text[last:m.start()])
                opened = m.start()
            depth += 1
        elif depth:
            depth -= 1
            if depth == 0:
                last = m.end()
    out.append(text[opened:] if depth else text[last:])
    return "".join(out)


def strip_wiki_markup(wikitext: str) -> str:
    """MediaWiki markup -> plain text, one paragraph per line (headings and tail sections dropped)."""
    wikitext = _remove_templates(_PRE_REF.sub("", _PRE_COMMENT.sub("", wikitext)))
    if "__" in wikitext:
        wikitext = _MAGIC_WORD.sub("", wikitext)
    # Plain [[title|text]] links are most of the remaining nodes, and mwparserfromhell's Python builder spends
    # ~3 us per node: replacing them by their text with one regex first halves what is left of the parse (same
    # rules as `_render_node`; the text stays wikitext, so entities and leftovers are handled as before).
    wikitext = _PRE_LINK.sub(_link_text, _remove_tables(wikitext))
    # Bullets and numbers of list items: rendered as nothing (the node would be a Tag per item).
    wikitext = _LIST_MARK.sub("", wikitext)
    code = mwparserfromhell.parse(wikitext, skip_style_tags=True)
    parts: list[str] = []
    skip_level = 0  # > 0 while inside a dropped section (References, See also, ...) of that heading level
    for node in code.nodes:
        if isinstance(node, N.Heading):
            title = _render(node.title).strip().lower()
            if skip_level and node.level > skip_level:
                continue
            skip_level = node.level if title in _DROP_SECTIONS else 0
            parts.append("\n")
            continue
        if not skip_level:
            parts.append(_render_node(node))
    text = "".join(parts)
    # Safety net for malformed markup mwparserfromhell leaves as text (unbalanced braces, stray tags).
    text = _LEFTOVER_REF.sub("", text)
    text = _LEFTOVER_TAG.sub("", text)
    lines = []
    for line in text.split("\n"):
        if _TABLE_LINE.match(line):
            continue
        # Removed templates/refs leave double spaces and "word ." behind.
        line = _SPACE_PUNCT.sub(r"\1", _MULTI_SPACE.sub(" ", _LEFTOVER_MARKUP.sub("", line))).strip()
        if line.startswith(("*", "#", ":", ";")):
            line = line.lstrip("*#:; ")
        if line:
            lines.append(line)
    return "\n".join(lines)


def _render(code) -> str:
    return "".join(_render_node(n) for n in code.nodes)


def _render_node(node) -> str:
    if isinstance(node, N.Text):
        return node.value
    if isinstance(node, N.Wikilink):
        title = str(node.title).strip()
        if _hidden_link(title, node.text is not None):
            return ""
        if node.text is not None:
            return _render(node.text)
        return title.lstrip(":").split("#")[0] if not title.startswith("#") else title[1:]
    if isinstance(node, N.Tag):
        if node.wiki_markup == "{|":
            return ""
        tag = str(node.tag).strip().lower()
        if tag == "br":
            return " "
        if tag in _DROP_TAGS or node.contents is None or node.self_closing:
            return ""
        if tag in _KEEP_CONTENT_TAGS or node.wiki_markup:
            return _render(node.contents)
        return ""
    if isinstance(node, N.ExternalLink):
        return _render(node.title) if node.title is not None else ""
    if isinstance(node, N.HTMLEntity):
        try:
            return node.normalize()
        except (ValueError, OverflowError):
            return ""
    # Templates, comments, parser arguments, headings inside tags: no running text.
    return ""

