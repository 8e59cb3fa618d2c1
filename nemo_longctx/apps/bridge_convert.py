"""``nemo-longctx bridge-export checkpoint=<dir> output=<HF dir> [source=<HF dir>]``: a checkpoint Megatron-Bridge saved
(``nemo-longctx bridge init_from=<HF dir> checkpoint.save=<dir>``) -> a Hugging Face model directory, through
Bridge's own ``AutoBridge`` (``integrations/bridge/hf.py``). Python: ``integrations.bridge.hf.export_hf(checkpoint,
output, source=None)``. Every problem with the arguments is reported at once before anything is written; the output
directory appears only when complete. Exit code 0 on success, 2 for bad arguments/inputs, 1 for a failure while
converting.
"""

from __future__ import annotations

import sys
import time
from typing import List, Optional

from nemo_longctx.shared.converter_args import parse_args

EXPORT_USAGE = """usage: nemo-longctx bridge-export checkpoint=<Bridge checkpoint.save dir, or one of its iter_* \\
    dirs> output=<new HF dir> [source=<the HF model dir it was trained from; default: the checkpoint's init_from>]

Loads the checkpoint's weights into the source's Megatron model (Megatron-Bridge's build_and_load_model) and writes
them with AutoBridge.save_hf_pretrained (config.json, tokenizer and generation files: the source's); the result loads
with transformers.AutoModelForCausalLM.from_pretrained. Runs on one CPU process (gloo).
"""


def export_main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(list(sys.argv[1:] if argv is None else argv), ["checkpoint", "output"], EXPORT_USAGE,
                      optional=["source"])
    from nemo_longctx.integrations.bridge import hf

    problems = hf.export_problems(args["checkpoint"], args["output"], args.get("source"))[2]
    if problems:  # before Bridge is imported
        print("nemo-longctx bridge-export: invalid arguments:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        sys.exit(2)
    from nemo_longctx.integrations.bridge import cpu_compat
    from nemo_longctx.options import ConfigError

    cpu_compat.apply()  # no-op with CUDA
    t0 = time.perf_counter()
    try:
        out = hf.export_hf(args["checkpoint"], args["output"], args.get("source"))
    except ConfigError as e:
        print(f"nemo-longctx bridge-export: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"nemo-longctx bridge-export: wrote {out} in {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    export_main()
