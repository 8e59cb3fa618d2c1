"""``nemo-longctx fuzz``: the draw and the case words (no Megatron), a fixed seed that must pass, and every planted
defect that must fail it (the fuzzer's own check that it can see that class of defect).

The runs call the app's ``main`` in this process: its ranks fork from one fork server (Megatron-core imported once for
every run of this file)."""

from __future__ import annotations

import re

import pytest

from nemo_longctx.integrations.megatron.fuzz_cases import (INJECTIONS, draw_cases, inject_accepts, option_problems,
                                                           parse_case)

CI_SEED, CI_CASES, CI_WORLD = 1, 6, 4


def test_the_same_seed_draws_the_same_cases_and_their_words_read_back():
    a, b = draw_cases(7, 30, 8), draw_cases(7, 30, 8)
    assert [c.words() for c in a] == [c.words() for c in b]
    assert [c.words() for c in draw_cases(8, 30, 8)] != [c.words() for c in a]
    for case in a:
        assert case.world <= 8
        back = parse_case(case.words())
        assert back.words() == case.words() and back.refused == case.refused
    # the draw spans the axes the fuzzer promises (over enough cases)
    many = draw_cases(3, 300, 8)
    assert {c.model for c in many} == {"gqa", "mqa", "mha", "moe", "mla", "window"}
    assert {c.state for c in many} == {"ddp", "distributed", "fsdp"}
    assert {c.cp_algorithm for c in many if c.cp > 1} == {"ring", "ulysses", "hybrid"}
    assert any(c.pp > 1 and c.vpp for c in many) and any(c.ep > 1 for c in many)
    assert any(c.data == "packed" for c in many) and any(c.sp for c in many)


def test_refused_combinations_are_counted_with_the_option_models_words():
    case = parse_case("model=gqa pp=2 dp=2 cp=ring cp.size=2 state=fsdp micro_batches=2")
    assert case.refused and "megatron_fsdp" in case.refused[0]
    assert option_problems(parse_case("model=gqa ep=2 dp=2")) == ["ep=2 needs a MoE model (model=moe)"]
    with pytest.raises(ValueError, match=r"tp=x: not an integer.*unknown key 'colour'"):
        parse_case("model=gqa tp=x colour=blue")
    with pytest.raises(ValueError, match="must sum to 64"):
        parse_case("model=gqa data=packed documents=16,16")


def test_injected_defects_draw_only_cases_they_reach():
    for kind, (_, reaches) in INJECTIONS.items():
        cases = draw_cases(5, 10, 4, inject_accepts(kind))
        assert all(reaches(c) and not c.refused for c in cases), kind


def _fuzz(capsys, *argv):
    from nemo_longctx.apps.fuzz import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def _rows(out):
    return [line for line in out.splitlines() if re.match(r"^\s*\d+\s+\d+\s+(passed|FAILED|refused)", line)]


def test_the_ci_seed_passes(capsys):
    code, out, err = _fuzz(capsys, "--seed", str(CI_SEED), "--cases", str(CI_CASES), "--max-world", str(CI_WORLD))
    rows = _rows(out)
    assert code == 0, out + err
    assert len(rows) == CI_CASES
    assert sum(" passed " in r for r in rows) >= 3, out  # most drawn cases train (refusals are reported, not run)
    for r in rows:
        if " passed " in r:
            loss, norm, param, replicas = (float(x) for x in r.split()[3:7])
            assert loss <= 1e-4 and norm <= 1e-4 and param <= 1e-3 and replicas <= 1e-4


@pytest.mark.parametrize("kind", sorted(INJECTIONS))
def test_every_planted_defect_fails_the_fuzzer(capsys, kind):
    code, out, err = _fuzz(capsys, "--seed", "2", "--cases", "2", "--max-world", str(CI_WORLD), "--inject", kind)
    rows = _rows(out)
    assert code == 1, out + err
    assert any(" FAILED " in r for r in rows), out
    assert "nemo-longctx fuzz --case '" in err  # the failing case's words, to reproduce it
    if kind == "cp_inactive":  # stopped by the run guard, not only by the comparison
        assert "run guard (step 0)" in out + err


def test_inject_list_and_bad_arguments(capsys):
    code, out, _ = _fuzz(capsys, "--inject", "list")
    assert code == 0 and all(kind in out for kind in INJECTIONS)
    code, _, err = _fuzz(capsys, "--inject", "nonsense")
    assert code == 2 and "zigzag_slice" in err
    code, _, err = _fuzz(capsys, "--case", "model=gqa tp=x")
    assert code == 2 and "tp=x: not an integer" in err
