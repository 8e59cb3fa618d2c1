"""``nemo-longctx fuzz``: every parallel composition against one rank, drawn from a seed.

    nemo-longctx fuzz --seed S --cases K [--max-world N] [--inject KIND] [--case 'WORDS' ...]

Each case (``integrations.megatron.fuzz_cases``) is trained twice with Megatron-core's own machinery on gloo
(``integrations.megatron.fuzz_harness``): once on one rank (the reference: same model, same global batch) and once
in its layout; the per-step losses, the per-step gradient norms and the parameters after the steps must agree, and
every replica of a parameter must hold the same value. One row per case; exit 1 when any case fails.

The ranks are started once (``max-world`` processes forked from a server that imported torch and Megatron-core) and
run every case: for each, the first ``world`` of them join a new default process group, train, and leave it. A rank
that dies or a case that runs past ``--case-timeout`` fails that case; the ranks are then started again for the next.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from nemo_longctx.integrations.megatron.fuzz_cases import (INJECTIONS, Case, draw_cases, inject_accepts,
                                                           parse_case)

# relative tolerances (fp32; reduction order differs between layouts): observed differences are 1e-8 .. 3e-5
TOLERANCES = {"loss": 1e-4, "grad_norm": 1e-4, "param": 1e-3, "replicas": 1e-4}
PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt",
           "megatron.core.pipeline_parallel", "megatron.core.optimizer", "megatron.core.distributed",
           "nemo_longctx.integrations.megatron.fuzz_harness"]


# ------------------------------------------------------------------------------------------------ the ranks
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, tasks: Any, results: Any) -> None:
    """One pooled rank: run tasks ``(tag, port, world, case words, reference?, init, inject)`` until ``None``."""
    import torch
    import torch.distributed as dist

    from nemo_longctx.integrations.megatron import fuzz_harness
    from nemo_longctx.integrations.megatron.patches import LEDGER

    torch.set_num_threads(1)
    LEDGER.apply()
    while True:
        task = tasks.get()
        if task is None:
            break
        tag, port, world, words, reference, init, inject = task
        try:
            case = parse_case(words)
            case = case.reference() if reference else case
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
            try:
                out = fuzz_harness.train_case(case, pickle.loads(init) if init else None, inject)
            finally:
                dist.destroy_process_group()
            results.put((tag, rank, "ok", pickle.dumps(out) if rank == 0 else b""))
        except fuzz_harness.OptionsRefused as e:
            results.put((tag, rank, "refused (options)", str(e)))
        except fuzz_harness.StackRefused as e:
            results.put((tag, rank, "refused (stack)", str(e)))
        except BaseException as e:  # noqa: BLE001 - reported as the case's failure
            results.put((tag, rank, "error", f"{fuzz_harness.first_line(e)}\n{traceback.format_exc()}"))
    results.close()
    results.join_thread()


class RankPool:
    """``size`` ranks started once and reused for every case."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(PRELOAD)
        self.procs: List[Any] = []
        self.tasks: List[Any] = []
        self.results: Any = None
        self.tag = 0
        self.start()

    def start(self) -> None:
        self.results = self.ctx.Queue()
        self.tasks = [self.ctx.Queue() for _ in range(self.size)]
        self.procs = [self.ctx.Process(target=_rank_main, args=(r, self.tasks[r], self.results), daemon=True)
                      for r in range(self.size)]
        for p in self.procs:
            p.start()

    def stop(self, kill: bool = False) -> None:
        for p, q in zip(self.procs, self.tasks):
            if not kill and p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                p.kill()
                p.join()
        self.procs = []

    def restart(self) -> None:
        self.stop(kill=True)
        self.start()

    def run(self, world: int, words: str, reference: bool, init: Optional[bytes], inject: Optional[str],
            timeout: float) -> Dict[int, tuple]:
        """Run one task on ranks 0..world-1; {rank: (status, payload)}. A dead rank or the timeout: raises
        ``RuntimeError`` after restarting the ranks."""
        self.tag += 1
        port = _free_port()
        for r in range(world):
            self.tasks[r].put((self.tag, port, world, words, reference, init, inject))
        got: Dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        while len(got) < world:
            try:
                tag, rank, status, payload = self.results.get(timeout=1.0)
            except queue_module.Empty:
                dead = [r for r in range(world) if not self.procs[r].is_alive()]
                if dead or time.monotonic() > deadline:
                    why = (f"rank {dead[0]} died (exit code {self.procs[dead[0]].exitcode})" if dead
                           else f"timed out after {timeout:.0f} s")
                    self.restart()
                    raise RuntimeError(why) from None
                continue
            if tag == self.tag:
                got[rank] = (status, payload)
        return got


# ------------------------------------------------------------------------------------------------- the cases
@dataclass
class Row:
    index: int
    case: Case
    status: str = ""  # passed | FAILED | refused (options) | refused (stack)
    diffs: Dict[str, float] = field(default_factory=dict)
    why: str = ""
    seconds: float = 0.0


def _outcome(results: Dict[int, tuple]) -> tuple:
    """(status, payload or message) of one task's ranks: an error beats a refusal beats ok."""
    for wanted in ("error", "refused (options)", "refused (stack)"):
        for rank in sorted(results):
            status, payload = results[rank]
            if status == wanted:
                return wanted, f"rank {rank}: {payload}"
    return "ok", results[0][1]


def _run(pool: RankPool, world: int, words: str, reference: bool, init: Optional[bytes], inject: Optional[str],
         timeout: float) -> tuple:
    """(status, payload) of one run of a case on the pool; after a rank's error the ranks are started again (a rank
    that failed mid-case leaves process groups and buffers behind that no later case may meet)."""
    status, payload = _outcome(pool.run(world, words, reference, init, inject, timeout))
    if status == "error":
        pool.restart()
    return status, payload


def run_case(pool: RankPool, index: int, case: Case, inject: Optional[str], timeout: float) -> Row:
    from nemo_longctx.integrations.megatron.fuzz_harness import compare

    row = Row(index, case)
    if case.refused:
        row.status, row.why = "refused (options)", case.refused[0]
        return row
    start = time.monotonic()
    try:
        status, ref = _run(pool, 1, case.words(), True, None, None, timeout)
        if status == "ok":
            reference = pickle.loads(ref)
            status, got = _run(pool, case.world, case.words(), False, pickle.dumps(reference["init"]), inject,
                               timeout)
        else:
            got = f"reference: {ref}"
    except RuntimeError as e:  # a dead rank or the timeout
        status, got = "error", str(e)
    row.seconds = time.monotonic() - start
    if status != "ok":  # a refusal is reported as it is; an error fails the case
        row.status, row.why = "FAILED" if status == "error" else status, got
        return row
    row.diffs = compare(pickle.loads(got), reference)
    over = [k for k, v in row.diffs.items() if not v <= TOLERANCES[k]]
    row.status = "FAILED" if over else "passed"
    if over:
        row.why = "; ".join(f"{k} {row.diffs[k]:.2e} > {TOLERANCES[k]:.0e}" for k in over)
    return row


def _fmt(row: Row) -> str:
    d = row.diffs
    nums = " ".join(f"{d[k]:9.2e}" if k in d else f"{'-':>9}" for k in ("loss", "grad_norm", "param", "replicas"))
    return f"{row.index:>3} {row.case.world:>5} {row.status:<17} {nums} {row.seconds:6.1f}  {row.case.words()}"


HEADER = (f"{'#':>3} {'world':>5} {'result':<17} {'loss':>9} {'grad_norm':>9} {'param':>9} {'replicas':>9} "
          f"{'s':>6}  case (nemo-longctx fuzz --case '...')")


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="nemo-longctx fuzz",
        description="Train drawn parallel compositions (TP, SP, CP algorithm and size, PP with virtual stages, DP, "
                    "EP; DDP, distributed optimizer, Megatron-FSDP; recompute, offload, tiling, sequence chunks; "
                    "dense or packed documents; micro-batches) of tiny fp32 models (GQA, MQA, MHA, MoE, MLA, "
                    "sliding window) on CPU processes over gloo, each against the same model and global batch on one "
                    "rank. Exit 1 when a case differs.")
    parser.add_argument("--seed", type=int, default=1, help="the draw's seed (the same seed draws the same cases)")
    parser.add_argument("--cases", type=int, default=10, help="how many cases to draw")
    parser.add_argument("--max-world", type=int, default=8, help="the largest world size a case may have")
    parser.add_argument("--inject", metavar="KIND", help="plant a known defect (the run must then fail); "
                        "'--inject list' prints the kinds")
    parser.add_argument("--case", action="append", metavar="WORDS",
                        help="run this case instead of drawing (the words a row prints); repeatable")
    parser.add_argument("--case-timeout", type=float, default=120.0, help="seconds one run of a case may take")
    args = parser.parse_args(argv)
    if args.inject == "list":
        for kind, (what, _) in INJECTIONS.items():
            print(f"{kind:<16} {what}")
        sys.exit(0)
    if args.inject is not None and args.inject not in INJECTIONS:
        parser.error(f"--inject {args.inject}: one of {', '.join(INJECTIONS)} (or list)")
    if args.cases < 1 or args.max_world < 1:
        parser.error("--cases and --max-world must be at least 1")
    if args.case:
        try:
            cases = [parse_case(w) for w in args.case]
        except ValueError as e:
            parser.error(str(e))
    else:
        cases = draw_cases(args.seed, args.cases, args.max_world, inject_accepts(args.inject))
    size = max([c.world for c in cases if not c.refused] + [1])
    inject = f", defect planted: {args.inject}" if args.inject else ""
    print(f"nemo-longctx fuzz: {len(cases)} cases (seed {args.seed}, worlds up to {size}{inject}); tolerances "
          + ", ".join(f"{k} {v:.0e}" for k, v in TOLERANCES.items()), flush=True)
    print(HEADER, flush=True)
    start = time.monotonic()
    rows = []
    pool = RankPool(size)
    try:
        for i, case in enumerate(cases, 1):
            row = run_case(pool, i, case, args.inject, args.case_timeout)
            rows.append(row)
            print(_fmt(row), flush=True)
            if row.why:
                print(f"      {row.why.splitlines()[0]}", flush=True)
    finally:
        pool.stop()
    counts: Dict[str, int] = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    print(f"nemo-longctx fuzz: {summary} in {time.monotonic() - start:.0f} s", flush=True)
    failed = [r for r in rows if r.status == "FAILED"]
    for r in failed:
        print(f"\nFAILED case {r.index}: nemo-longctx fuzz --case '{r.case.words()}'\n{r.why}", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
