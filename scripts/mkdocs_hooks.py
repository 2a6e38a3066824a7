"""mkdocs hook (mkdocs.yml `hooks:`): the docstrings name objects with Sphinx roles (:func:`agg_loss`); the API pages
show the name as code without the role prefix."""

import re

_ROLE = re.compile(r":(?:func|mod|data|class|meth|attr|obj):(?=<code>)")


def strip_sphinx_roles(html: str) -> str:
    """`:func:<code>x</code>` -> `<code>x</code>` (only a role directly before rendered code)."""
    return _ROLE.sub("", html)


def on_page_content(html, page, config, files):
    return strip_sphinx_roles(html)
