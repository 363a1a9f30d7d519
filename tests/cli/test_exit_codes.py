"""The CLI's one exit-status table agrees with the codes the daemons exit with."""

from kvpool.cli import common
from kvpool.manager.store.recovery import EXIT_FENCED


def test_the_table_names_the_managers_fencing_exit():
    assert common.EXIT_FENCED == EXIT_FENCED


def test_every_code_in_the_table_is_documented_in_its_docstring():
    codes = {name: value for name, value in vars(common).items() if name.startswith("EXIT_")}
    assert codes["EXIT_UNREACHABLE"] == 3 and common.Unreachable.exit_code == 3
    for name, value in codes.items():
        assert f"{value:<3} {name}" in common.__doc__, name
