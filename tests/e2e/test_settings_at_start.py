"""`rlproxy serve` checks its settings at start: a misspelt `RLPROXY_TRAINER` key stops it with
one line naming the key and the nearest known one; an unknown `RLPROXY_` variable is named in a
warning with the nearest known variable, and the server serves."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import start_server, stop_server


def test_serve_refuses_a_misspelt_trainer_key_and_names_it(
    tmp_path: Path, model_data_dir: Path
) -> None:
    with pytest.raises(RuntimeError, match="server exited with 2") as exited:
        start_server(tmp_path, model_data_dir, {"RLPROXY_TRAINER": '{"learning_rat": 1e-4}'})
    assert (
        "rlproxy serve: RLPROXY_TRAINER: unknown trainer config field 'learning_rat' "
        "(did you mean 'learning_rate'?)"
    ) in str(exited.value)


def test_serve_names_an_unknown_variable_with_the_nearest_known_one(
    tmp_path: Path, model_data_dir: Path
) -> None:
    proc, _url, log = start_server(tmp_path, model_data_dir, {"RLPROXY_GROUP_MIN_SIZ": "2"})
    try:
        text = log.read_text()
    finally:
        stop_server(proc)
    assert (
        "unknown environment variable RLPROXY_GROUP_MIN_SIZ (did you mean "
        "RLPROXY_GROUP_MIN_SIZE?); rlproxy ignores it"
    ) in text


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ('{"lora_rank": "8"}', "rlproxy serve: RLPROXY_TRAINER: "),  # a value of the wrong type
        ("{not json", 'error parsing value for field "config"'),  # not JSON at all
    ],
)
def test_serve_refuses_a_trainer_setting_it_cannot_read_in_one_line(
    tmp_path: Path, model_data_dir: Path, value: str, says: str
) -> None:
    with pytest.raises(RuntimeError, match="server exited with 2") as exited:
        start_server(tmp_path, model_data_dir, {"RLPROXY_TRAINER": value})
    assert says in str(exited.value)
    assert "Traceback" not in str(exited.value)
