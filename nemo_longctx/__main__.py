"""``python -m nemo_longctx <command> ...`` = the ``nemo-longctx`` console script."""

from nemo_longctx.apps.cli import main

main()
