"""Imported first by the local launcher's fork server (``launch.start_method_for``), before the frameworks every rank
needs: the console set up as a rank's is (``console.setup`` with the launcher's ``log.level``, as rank 0), so that
what NeMo, Megatron and Lightning print while they are imported is filtered as it is when a rank imports them itself.
"""

from __future__ import annotations

import logging
import os

from nemo_longctx.shared import console, rank_server

rank_server.remember_environment()  # what each rank forked from here starts with (launch.run_rank swaps it)

# Python's last-resort output for a library's WARNING records (a message per line on stderr), with the console's
# filter (``console.setup`` gives it ``ConsoleFilter``); a rank's own logging set-up (Hydra's job logging) replaces it
if not logging.getLogger().handlers:
    logging.getLogger().addHandler(logging.StreamHandler())
console.setup(os.environ.get(console.LOG_LEVEL_VAR, "info"), 0)
