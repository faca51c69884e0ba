"""A shadow's inbox (`unbroken.launch.inbox.ShadowInbox`): the agent sends `WarmUp`,
`MapRetained` and `Promote` when their conditions hold, whatever the shadow is waiting for;
each wait takes what it needs and keeps or drops the rest."""

import io

import pytest

from unbroken.launch.inbox import ShadowInbox
from unbroken.messages import MapRetained, Promote, WarmUp, encode_json


def _inbox(*msgs) -> ShadowInbox:
    return ShadowInbox(io.StringIO("".join(encode_json(m).decode() + "\n" for m in msgs)))


def test_a_gpu_shadow_warms_up_on_its_line_then_maps_and_is_promoted():
    inbox = _inbox(WarmUp(), MapRetained(), Promote(spec="gen3.json"))
    maps = []
    assert inbox.await_warm_up() is False
    promote, _ = inbox.await_promotion(lambda: maps.append(1))
    assert promote == Promote(spec="gen3.json") and maps == [1]


def test_a_promotion_before_the_warm_up_line_is_kept_for_the_park():
    """The trainer failed before completing an iteration: no `WarmUp` ever comes; the shadow
    warms up at once and its park returns the kept `Promote` without reading more."""
    inbox = _inbox(Promote(spec="gen3.json", rank=1))
    assert inbox.await_warm_up() is True
    promote, _ = inbox.await_promotion(lambda: pytest.fail("nothing to map"))
    assert promote == Promote(spec="gen3.json", rank=1)


def test_a_shadow_that_did_not_wait_ignores_the_warm_up_line_at_its_park():
    inbox = _inbox(WarmUp(), Promote(spec="gen3.json"))
    promote, _ = inbox.await_promotion(lambda: pytest.fail("nothing to map"))
    assert promote.spec == "gen3.json"


def test_the_agent_closing_the_pipe_lets_the_shadow_go():
    with pytest.raises(SystemExit) as exc:
        _inbox(WarmUp()).await_promotion(lambda: None)
    assert exc.value.code == 0
    with pytest.raises(SystemExit):
        _inbox().await_warm_up()
