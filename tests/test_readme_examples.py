"""README.md's examples run: every ``nemo-longctx train ...`` and ``nemo-longctx plan ...`` command in a fenced
```` ```bash ```` block of README.md must exit 0 here (train commands as dry runs). The rules, the skip marker and
the helper shared with the manual's examples (``tests/test_docs.py``) are in ``tests/doc_examples.py``."""

from __future__ import annotations

from doc_examples import check_plan_commands, check_train_commands, listing, readme_commands


def test_readme_lists_runnable_commands():
    runnable, skipped = readme_commands()
    apps = {app for app, _, _ in runnable}
    assert apps == {"train", "plan"}, (runnable, skipped)
    print(listing(skipped))


def test_readme_train_commands_dry_run(tmp_path_factory):
    check_train_commands(readme_commands()[0], tmp_path_factory)


def test_readme_plan_commands_run(tmp_path):
    check_plan_commands(readme_commands()[0], tmp_path)
