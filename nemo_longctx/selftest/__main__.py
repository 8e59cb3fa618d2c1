"""``python -m nemo_longctx.selftest``: see ``nemo_longctx.selftest``."""

import sys

from nemo_longctx.selftest import main

if __name__ == "__main__":
    sys.exit(main())
