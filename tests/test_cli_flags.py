"""How the front end reads `--json` and `--debug`: from the parsed options, never by scanning argv.

An option's value that happens to read `--json` or `--debug` (a prompt) is a value.
"""

from __future__ import annotations

import json

import pytest

from kvctl.cli import main
from kvctl.errors import BadInput


def test_json_error_is_one_object_on_stdout(kvctl_home, capsys):
    assert main(["verify", "--name", "nosuch", "--json"]) == 2
    out = capsys.readouterr()
    assert json.loads(out.out)["exit_code"] == 2 and "no cluster named 'nosuch'" in out.err


def test_a_prompt_whose_text_is_json_is_not_the_option(kvctl_home, capsys):
    assert main(["verify", "--name", "nosuch", "--prompt", "--json"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "no cluster named 'nosuch'" in out.err  # the human error, no JSON


@pytest.mark.parametrize("argv", [["--debug", "verify", "--name", "nosuch"],
                                  ["verify", "--name", "nosuch", "--debug"]])
def test_debug_before_or_after_the_command_shows_the_traceback(kvctl_home, argv):
    with pytest.raises(BadInput, match="no cluster named 'nosuch'"):
        main(argv)


def test_a_prompt_whose_text_is_debug_is_not_the_option(kvctl_home, capsys):
    assert main(["verify", "--name", "nosuch", "--prompt", "--debug"]) == 2  # an error, not a traceback
    assert "no cluster named 'nosuch'" in capsys.readouterr().err
