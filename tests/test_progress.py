"""Progress of the preparations before training (``nemo_longctx/shared/progress.py``): plain lines in a batch log, a
tqdm bar on a terminal, the waiting ranks' lines; and ``data=documents``' tokenizing progress on a small corpus
(in-process: NeMo's tokenizer wrapper and Megatron's dataset builder are imported, ~20 s)."""

from __future__ import annotations

import io
import re
import time

import pytest

from nemo_longctx.shared import progress

LINE = re.compile(r"^nemo-longctx: data=documents: tokenizing: (\d+)% of [0-9.]+ KiB, ([\d,]+) documents, ([\d,]+) "
                  r"tokens, [\d,]+ tokens/s, eta \d+s$")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_every_tenth_and_every_interval():
    out = io.StringIO()
    with progress.Progress("work", total=1000, unit="items", stream=out, every_s=3600, quiet_s=0) as p:
        for _ in range(20):
            p.update(50, files=1)
    lines = out.getvalue().splitlines()
    assert [re.match(r"nemo-longctx: work: (\d+)% of 1,000 items, ", ln).group(1) for ln in lines] == \
        [str(10 * k) for k in range(1, 10)], lines  # each further tenth; the end is the caller's to say
    assert "\r" not in out.getvalue() and ", 2 files," in lines[0] and "eta " in lines[0], lines
    quiet = io.StringIO()  # nothing in the first seconds
    progress.Progress("work", total=1000, stream=quiet, every_s=0).update(500)
    assert quiet.getvalue() == ""
    out = io.StringIO()
    p = progress.Progress("work", total=None, unit="B", stream=out, every_s=0, quiet_s=0)
    p.update(3 * 1024 ** 2)
    assert re.fullmatch(r"nemo-longctx: work: 3\.0 MiB after 0s, [0-9.]+ [KMG]iB/s\n", out.getvalue()), out.getvalue()


def test_a_terminal_gets_a_bar():
    out = _Terminal()
    with progress.Progress("work", total=100, unit="items", stream=out) as p:
        p.update(40, files=3)
        p.update(60, files=1)
    text = out.getvalue()
    assert "\r" in text and "work: 100%" in text and "files=4" in text and "nemo-longctx:" not in text, text


def test_watch_directory_reports_bytes_written(tmp_path):
    out = io.StringIO()
    with progress.watch_directory("importing x into y", str(tmp_path), stream=out, every_s=0.05):
        (tmp_path / "weights").write_bytes(b"\0" * 4096)
        time.sleep(0.5)
    assert re.search(r"^nemo-longctx: importing x into y: 4\.0 KiB after 0s", out.getvalue(), re.M), out.getvalue()


def test_waiting_ranks_say_what_they_wait_for():
    calls = {"n": 0}

    def ready() -> bool:
        calls["n"] += 1
        return calls["n"] > 6

    out = io.StringIO()
    progress.wait_for(ready, "tokenize the documents into /d", rank=3, local_rank=0, poll_s=0.02, remind_s=0.05,
                      stream=out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "nemo-longctx: rank 3: waiting for rank 0 to tokenize the documents into /d", lines
    assert lines[1].startswith("nemo-longctx: rank 3: still waiting for rank 0 to tokenize the documents into /d ("
                               ) and "so far, up to 1h00m)" in lines[1], lines
    quiet = io.StringIO()  # one waiting rank per node speaks (local rank 0, or local rank 1 beside rank 0)
    progress.wait_for(lambda: calls["n"] > 8 or calls.update(n=calls["n"] + 1), "x", rank=5, local_rank=2,
                      poll_s=0.01, remind_s=0, stream=quiet)
    assert quiet.getvalue() == ""
    assert progress.speaks_for_node(1, 1) and progress.speaks_for_node(8, 0) and not progress.speaks_for_node(9, 1)
    with pytest.raises(TimeoutError, match="rank 2: rank 0 did not x within 0s"):
        progress.wait_for(lambda: False, "x", rank=2, timeout_s=0.05, poll_s=0.01, stream=io.StringIO())


def test_documents_preparation_prints_progress_in_a_batch_log(tmp_path, capsys, monkeypatch):
    import json

    from hf_models import corpus, make_tokenizer

    from nemo_longctx.integrations.nemo import documents
    from nemo_longctx.shared.run_spec import spec_from_dict

    tok = tmp_path / "tokenizer"
    make_tokenizer().save_pretrained(str(tok))
    docs = corpus(300, seed=1)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    spec = spec_from_dict({"output_dir": str(tmp_path / "out"), "seed": 1,
                           "data": {"kind": "documents", "paths": [str(tmp_path / "docs.jsonl")], "text_key": "text",
                                    "tokenizer": str(tok), "cache_dir": None, "split": "100,0,0"}})
    monkeypatch.setattr(progress, "EVERY_S", 3600.0)  # the every-tenth lines only (a test machine may be slow)
    monkeypatch.setattr(progress, "QUIET_S", 0.0)  # (a small input: done within the first seconds)
    out = documents.prepare(spec)
    err = capsys.readouterr()
    lines = [ln for ln in err.err.splitlines() if "tokenizing" in ln]
    shown = [int(LINE.match(ln).group(1)) for ln in lines]  # at the first document past each tenth of the bytes
    assert len(shown) == 9 and all(0 <= p - 10 * k <= 1 for k, p in enumerate(shown, 1)), err.err
    counts = [int(LINE.match(ln).group(2).replace(",", "")) for ln in lines]
    assert counts == sorted(counts) and 0 < counts[0] < counts[-1] < len(docs), lines
    summary = json.loads((out / documents.DONE).read_text())
    assert summary["documents"] == len(docs)
    assert f"data=documents: {len(docs)} documents, {summary['tokens']} tokens" in err.out
