"""MediaWiki markup to text (data/wikitext.py). Whole dumps through the reader: test_data_readers.py."""
from __future__ import annotations

from bertrain.data.wikitext import strip_wiki_markup


def test_strip_wiki_markup_pieces():
    wt = ("'''Foo''' is a [[bar (thing)|bar]] and [[baz]].<ref name=x>{{cite web|title=T}}</ref> "
          "It has {{convert|3|km}} size.<!-- hidden -->\n"
          "{| class=wikitable\n|-\n| cell || cell2\n|}\n[[File:X.png|thumb|caption]]\n"
          "== History ==\nText &amp; more.\n== References ==\n{{reflist}}\nRef text.\n[[Category:Things]]")
    out = strip_wiki_markup(wt)
    assert out.splitlines() == ["Foo is a bar and baz. It has size.", "Text & more."]
