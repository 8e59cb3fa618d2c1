"""``python -m nemo_longctx <command> ...`` = the ``nemo-longctx`` console script."""

from nemo_longctx.cli import main

main()
