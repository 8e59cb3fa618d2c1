"""``nemo-longctx import source=<HF dir> output=<dir>`` and ``nemo-longctx export checkpoint=<dir> output=<HF dir>``.

Arguments are ``key=value`` (OmegaConf dot-list syntax, as for ``train``). Every problem with the arguments and the
source is reported at once, before anything is written; the output directory appears only when complete
(``integrations/nemo/hf.py``). Exit code 0 on success, 2 for bad arguments/inputs, 1 for a failure while converting.
"""

from __future__ import annotations

import sys
import time
from typing import List, Optional

from nemo_longctx.options import ConfigError
from nemo_longctx.shared.converter_args import parse_args

IMPORT_USAGE = """usage: nemo-longctx import source=<local Hugging Face model dir> output=<new NeMo checkpoint dir>

Converts a Llama (3.x) or Qwen2/2.5 Hugging Face checkpoint with NeMo's own importer (llm.import_ckpt). Then:
  nemo-longctx train init_from=<output> model.seq_length=... [model.rotary_base=... | model.scale_factor=...]
"""
EXPORT_USAGE = """usage: nemo-longctx export checkpoint=<NeMo checkpoint dir, or a run's output_dir> output=<new HF dir>

Converts a checkpoint trained from an imported model back to Hugging Face (NeMo's exporter, llm.export_ckpt); the
result loads with transformers.AutoModelForCausalLM.from_pretrained.
"""


def _run(fn, usage: str, **kwargs) -> None:
    from nemo_longctx.integrations.nemo import compat

    compat.apply()  # NeMo's patch ledger, once (its CPU-only rows only without CUDA)
    t0 = time.perf_counter()
    try:
        out = fn(**kwargs)
    except ValueError as e:  # ConfigError included: every problem, each naming its argument
        print(f"nemo-longctx: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"nemo-longctx: wrote {out} in {time.perf_counter() - t0:.1f} s", flush=True)


def _early_problems(problems: List[str]) -> None:
    """Report input problems found without importing NeMo (fast), exit 2."""
    if problems:
        print(f"nemo-longctx: {ConfigError(problems)}", file=sys.stderr)
        sys.exit(2)


def import_main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(list(sys.argv[1:] if argv is None else argv), ["source", "output"], IMPORT_USAGE)
    from nemo_longctx.integrations.nemo import hf  # imports neither nemo nor megatron at module level

    _early_problems(hf.hf_source_problems(args["source"]) + hf.output_problems(args["output"]))
    _run(hf.import_hf, IMPORT_USAGE, source=args["source"], output=args["output"])


def export_main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(list(sys.argv[1:] if argv is None else argv), ["checkpoint", "output"], EXPORT_USAGE)
    from nemo_longctx.integrations.nemo import hf

    _early_problems(hf.export_problems(args["checkpoint"], args["output"])[1])
    _run(hf.export_hf, EXPORT_USAGE, checkpoint=args["checkpoint"], output=args["output"])


if __name__ == "__main__":
    cmd = sys.argv.pop(1) if len(sys.argv) > 1 else ""
    {"import": import_main, "export": export_main}.get(cmd, lambda: sys.exit(f"usage: {__file__} import|export"))()
