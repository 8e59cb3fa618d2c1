"""Shared by the self-test sections: result rows, the report table, status strings, dtype tables and formatting
helpers."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import List

import torch

PASS, FAIL, SKIP, NA, INFO = "PASS", "FAIL", "SKIP", "n/a", "INFO"

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass
class Row:
    section: str
    check: str
    device: str
    dtype: str
    status: str
    detail: str = ""


class Report:
    def __init__(self, stream=None) -> None:
        self.rows: List[Row] = []
        self.stream = stream or sys.stdout

    def add(self, section: str, check: str, device: str, dtype: str, status: str, detail: str = "") -> Row:
        row = Row(section, check, device, dtype, status, detail)
        self.rows.append(row)
        print(f"  [{status:4s}] {section:7s} {check:28s} {device:5s} {dtype:5s} {detail}", file=self.stream,
              flush=True)
        return row

    def failed(self) -> List[Row]:
        return [r for r in self.rows if r.status == FAIL]

    def table(self) -> str:
        head = ("section", "check", "device", "dtype", "result", "detail")
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.rows:
            detail = r.detail.replace("|", "/")
            lines.append(f"| {r.section} | {r.check} | {r.device} | {r.dtype} | {r.status} | {detail} |")
        return "\n".join(lines)


def dtype_label(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def format_error(x: float) -> str:
    return "inf" if x == float("inf") else f"{x:.2e}"
