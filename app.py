"""A Hugging Face Space's entry point: batchfit's web app (src/batchfit/cli/webapp.py).

Locally: ``pip install -e '.[ui]'`` then ``batchfit ui``."""

from batchfit.cli.webapp import build_app

build_app().queue().launch()
