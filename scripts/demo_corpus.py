"""English prose for the bundled demo model: the paragraphs of the Python 3.11 documentation.

Source: the Debian package python3.11-doc (HTML under /usr/share/doc/python3.11/html; PSF
licence). Keeps the text of <p> paragraphs and of <li>/<dd> items that hold prose directly;
drops code (<pre>), tables, tables of contents, navigation, sidebars, index pages and
headings. Writes one paragraph per line; pages are separated by a line holding only the EOS
token `<|endoftext|>`.

    apt-get install -y python3.11-doc
    python scripts/demo_corpus.py .demo_data/corpus.txt
"""
from __future__ import annotations

import argparse
import html.parser
import re
import sys
from pathlib import Path

EOS = "<|endoftext|>"
DEFAULT_ROOT = "/usr/share/doc/python3.11/html"
SKIP_FILES = re.compile(r"^(genindex.*|py-modindex|search|contents|index|copyright|license)\.html$")
# Elements whose whole subtree is dropped, and div/nav classes that are not prose.
SKIP_TAGS = {"pre", "table", "nav", "script", "style", "h1", "h2", "h3", "h4", "h5", "h6", "dt", "footer",
             "head", "title", "button", "form", "select"}
SKIP_CLASSES = {"toctree-wrapper", "sphinxsidebar", "related", "footer", "highlight", "headerlink", "contents",
                "topic", "sidebar", "mobile-nav", "clearer", "versionmodified"}
BLOCKS = {"p", "li", "dd"}
VOID = {"br", "img", "hr", "meta", "link", "input", "wbr", "col", "area", "base", "source"}


class ProseParser(html.parser.HTMLParser):
    """Collects paragraph text from the main body of one Sphinx HTML page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, bool, bool]] = []  # (tag, skipped subtree, is the main body)
        self.in_body = 0
        self.skip = 0
        self.blocks: list[list[str]] = []  # text of the open <p>/<li>/<dd> elements, innermost last
        self.paragraphs: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag in VOID:
            return
        attrs = dict(attrs)
        classes = set((attrs.get("class") or "").split())
        body = tag == "div" and "body" in classes and attrs.get("role") == "main"
        skip = tag in SKIP_TAGS or bool(classes & SKIP_CLASSES)
        self.stack.append((tag, skip, body))
        self.in_body += body
        self.skip += skip
        if tag in BLOCKS and self.in_body and not self.skip:
            if self.blocks:  # a nested block: what the outer one said so far is its own paragraph
                self._flush(self.blocks[-1])
            self.blocks.append([])

    def handle_endtag(self, tag):
        if tag in VOID or not any(t == tag for t, _, _ in self.stack):
            return
        while self.stack:  # close unclosed children too (the HTML is tidy, but be safe)
            t, skip, body = self.stack.pop()
            if t in BLOCKS and self.in_body and not self.skip and self.blocks:
                self._flush(self.blocks.pop())
            self.in_body -= body
            self.skip -= skip
            if t == tag:
                break

    def handle_data(self, data):
        if self.in_body and not self.skip and self.blocks:
            self.blocks[-1].append(data)

    def _flush(self, parts: list[str]) -> None:
        text = normalise("".join(parts))
        parts.clear()
        if is_prose(text):
            self.paragraphs.append(text)


def normalise(text: str) -> str:
    text = text.replace("\u00b6", "").replace("\u00a0", " ")
    return re.sub(r"\s+", " ", text).strip()


def is_prose(text: str) -> bool:
    """Sentences, not fragments: enough words, mostly letters, ends like a sentence."""
    words = text.split()
    if len(words) < 6 or len(text) < 40:
        return False
    letters = sum(c.isalpha() or c == " " for c in text)
    return letters / len(text) > 0.8 and text[-1] in ".:!?)\"'"


def page_paragraphs(path: Path) -> list[str]:
    parser = ProseParser()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    parser.close()
    return parser.paragraphs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="corpus file to write")
    p.add_argument("--root", default=DEFAULT_ROOT, help="the HTML documentation tree")
    args = p.parse_args(argv)
    root = Path(args.root)
    pages = sorted(f for f in root.rglob("*.html")
                   if not SKIP_FILES.match(f.name) and not f.relative_to(root).parts[0].startswith("_"))
    if not pages:
        sys.exit(f"no HTML under {root}: apt-get install -y python3.11-doc")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    n_par = n_pages = 0
    with open(args.out, "w", encoding="utf-8") as out:
        for page in pages:
            paragraphs = page_paragraphs(page)
            if not paragraphs:
                continue
            out.write("\n".join(paragraphs) + f"\n{EOS}\n")
            n_par += len(paragraphs)
            n_pages += 1
    size = Path(args.out).stat().st_size
    print(f"{args.out}: {n_pages} pages, {n_par} paragraphs, {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
