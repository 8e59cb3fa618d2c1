"""NeMo-Run's CLI entry point (``[project.entry-points."nemo_run.cli"] llm``: merged into NeMo's ``nemo llm``):
importing it registers our factories, ``<recipe>_long_context`` for ``llm.pretrain`` and the plugins ``long_context``
(``integrations/nemo/recipes.py``) and ``long_context_planned`` (``nemo_run_planned.py``: it plans with the
``nemo-longctx plan`` app's configuration, so it sits in the app layer)."""

from nemo_longctx.apps import nemo_run_planned  # noqa: F401
from nemo_longctx.integrations.nemo import recipes  # noqa: F401
